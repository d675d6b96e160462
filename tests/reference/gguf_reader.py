"""A small, independent GGUF v3 reader (pure Python + numpy).

Written from the GGUF specification, not from Merlin's C++ reader, so that the
reference model does not share bugs with the code under test.

Layout of a GGUF file (all little-endian):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x  (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset (offsets are aligned too)
Strings are u64 length + UTF-8 bytes (no terminator). Arrays are u32 element
type + u64 count + elements (arrays may nest). Tensor dims are listed
fastest-varying first, so numpy's shape is the reversed list.
"""

import struct
import sys

import numpy as np

GGUF_MAGIC = b"GGUF"

# Metadata value types.
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, \
    T_UINT64, T_INT64, T_FLOAT64 = range(13)

_SCALAR_FMT = {
    T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h",
    T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?",
    T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d",
}
_SCALAR_NP = {
    T_UINT8: "<u1", T_INT8: "<i1", T_UINT16: "<u2", T_INT16: "<i2",
    T_UINT32: "<u4", T_INT32: "<i4", T_FLOAT32: "<f4", T_BOOL: "<u1",
    T_UINT64: "<u8", T_INT64: "<i8", T_FLOAT64: "<f8",
}

# ggml tensor types this reader can dequantize.
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0",
}


class GGUFError(Exception):
    pass


class TensorInfo:
    def __init__(self, name, dims, ggml_type, offset):
        self.name = name
        self.dims = tuple(dims)          # GGUF order: fastest-varying first
        self.ggml_type = ggml_type
        self.offset = offset             # relative to the data section
        self.abs_offset = None           # filled in once the data section is known

    @property
    def shape(self):
        """numpy (row-major) shape: the GGUF dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self):
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def type_name(self):
        return GGML_TYPE_NAMES.get(self.ggml_type, str(self.ggml_type))

    def __repr__(self):
        return "TensorInfo(%s, dims=%s, type=%s, offset=%d)" % (
            self.name, list(self.dims), self.type_name, self.offset)


class _Cursor:
    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def take(self, n):
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError("truncated file: need %d bytes at offset %d (size %d)" % (n, self.pos, len(self.buf)))
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def scalar(self, vtype):
        fmt = _SCALAR_FMT[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def u32(self):
        return self.scalar(T_UINT32)

    def u64(self):
        return self.scalar(T_UINT64)

    def string(self):
        n = self.u64()
        raw = bytes(self.take(n))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Token pieces are supposed to be UTF-8; keep the bytes visible rather than failing.
            return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype, depth=0):
        if vtype in _SCALAR_FMT:
            return self.scalar(vtype)
        if vtype == T_STRING:
            return self.string()
        if vtype == T_ARRAY:
            if depth > 16:
                raise GGUFError("arrays nested too deeply")
            etype = self.u32()
            count = self.u64()
            if etype in _SCALAR_NP:
                size = np.dtype(_SCALAR_NP[etype]).itemsize
                if count * size > len(self.buf) - self.pos:
                    raise GGUFError("array of %d elements runs past the end of the file" % count)
                arr = np.frombuffer(self.take(count * size), dtype=_SCALAR_NP[etype])
                if etype == T_BOOL:
                    arr = arr.astype(bool)
                return arr.tolist()
            if etype == T_STRING or etype == T_ARRAY:
                if count > len(self.buf) - self.pos:  # every element takes at least one byte
                    raise GGUFError("array of %d elements runs past the end of the file" % count)
                return [self.value(etype, depth + 1) for _ in range(count)]
            raise GGUFError("unknown array element type %d" % etype)
        raise GGUFError("unknown metadata value type %d" % vtype)


class GGUFReader:
    """Parses a GGUF file; `metadata` is a dict, `tensors` an ordered dict name -> TensorInfo."""

    def __init__(self, path):
        self.path = path
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(self._mm)
        cur = _Cursor(buf)
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFError("%s: not a GGUF file (bad magic)" % path)
        self.version = cur.u32()
        if self.version not in (2, 3):
            raise GGUFError("%s: unsupported GGUF version %d" % (path, self.version))
        n_tensors = cur.u64()
        n_kv = cur.u64()
        self.metadata = {}
        self.metadata_types = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.u32()
            self.metadata[key] = cur.value(vtype)
            self.metadata_types[key] = vtype
        self.tensors = {}
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            if n_dims > 8:
                raise GGUFError("tensor %s has %d dims" % (name, n_dims))
            dims = [cur.u64() for _ in range(n_dims)]
            ggml_type = cur.u32()
            offset = cur.u64()
            if name in self.tensors:
                raise GGUFError("duplicate tensor %s" % name)
            self.tensors[name] = TensorInfo(name, dims, ggml_type, offset)
        self.alignment = int(self.metadata.get("general.alignment", 32))
        if self.alignment <= 0 or (self.alignment & (self.alignment - 1)):
            raise GGUFError("bad general.alignment %d" % self.alignment)
        self.data_offset = (cur.pos + self.alignment - 1) // self.alignment * self.alignment
        for t in self.tensors.values():
            if t.offset % self.alignment:
                raise GGUFError("tensor %s offset %d is not aligned to %d" % (t.name, t.offset, self.alignment))
            t.abs_offset = self.data_offset + t.offset
            nbytes = self._nbytes(t)
            if nbytes is not None and t.abs_offset + nbytes > len(self._mm):
                raise GGUFError("tensor %s data runs past the end of the file" % t.name)

    @staticmethod
    def _nbytes(t):
        per = {GGML_F32: 4, GGML_F16: 2, GGML_BF16: 2}.get(t.ggml_type)
        return None if per is None else per * t.n_elements

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def tensor(self, name):
        """The tensor dequantized to a float32 numpy array of numpy shape (GGUF dims reversed)."""
        t = self.tensors[name]
        n = t.n_elements
        if t.ggml_type == GGML_F32:
            a = np.frombuffer(self._mm, dtype="<f4", count=n, offset=t.abs_offset).astype(np.float32)
        elif t.ggml_type == GGML_F16:
            a = np.frombuffer(self._mm, dtype="<f2", count=n, offset=t.abs_offset).astype(np.float32)
        elif t.ggml_type == GGML_BF16:
            raw = np.frombuffer(self._mm, dtype="<u2", count=n, offset=t.abs_offset)
            a = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            raise GGUFError("tensor %s has type %s, which this reference reader does not dequantize"
                            % (name, t.type_name))
        return a.reshape(t.shape)


def _summary(path):
    r = GGUFReader(path)
    print("GGUF v%d, %d metadata keys, %d tensors, alignment %d, data at %d"
          % (r.version, len(r.metadata), len(r.tensors), r.alignment, r.data_offset))
    for k, v in r.metadata.items():
        if isinstance(v, list):
            print("  %s = [%d items] %r..." % (k, len(v), v[:5]))
        else:
            print("  %s = %r" % (k, v))
    for t in r.tensors.values():
        print("  %r" % t)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        _summary(p)
