#!/usr/bin/python3
"""Writes deliberately broken GGUF files for tests/cli/bad_input.sh (standard library only).

    make_bad_gguf.py OUT_DIR                   small valid files with exactly one thing wrong each
    make_bad_gguf.py --truncate SRC OUT_PREFIX truncated copies of the valid GGUF file SRC:
                                               OUT_PREFIX.{header,kv,tensor_info,data}.gguf
"""
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz"))
import make_seed_corpus as g  # noqa: E402

BASE_KV = [("general.architecture", g.STRING, "llama"), ("general.name", g.STRING, "bad")]
BASE_T = [("a", [4], g.T_F32, g.f32_bytes([1, 2, 3, 4])), ("b", [2, 2], g.T_F32, g.f32_bytes([5, 6, 7, 8]))]


def nested(depth):
    """The encoded value of a depth-deep array of arrays ending in an empty I32 array: [[[...[]...]]]."""
    return g.Raw(struct.pack("<IQ", g.ARRAY, 1) * (depth - 1) + struct.pack("<IQ", g.I32, 0))


def files():
    f = {}
    valid = g.build_gguf(BASE_KV, BASE_T)
    f["valid_not_a_model.gguf"] = valid
    f["wrong_magic.gguf"] = b"GGUX" + valid[4:]
    f["zero_magic.gguf"] = b"\0" * 4 + valid[4:]
    f["wrong_version.gguf"] = g.build_gguf(BASE_KV, BASE_T, version=99)
    f["version_0.gguf"] = g.build_gguf(BASE_KV, BASE_T, version=0)
    f["huge_tensor_count.gguf"] = g.build_gguf(BASE_KV, BASE_T, n_tensors=2**60)
    f["huge_kv_count.gguf"] = g.build_gguf(BASE_KV, BASE_T, n_kv=2**60)
    f["tensor_offset_past_end.gguf"] = g.build_gguf(BASE_KV, BASE_T, offsets=[None, 1 << 20])
    f["tensor_offset_overflow.gguf"] = g.build_gguf(BASE_KV, BASE_T, offsets=[None, 2**64 - 32])
    f["unknown_tensor_type.gguf"] = g.build_gguf(BASE_KV, BASE_T, types=[250, None])
    # A key whose string length is 2^60.
    v = bytearray(valid)
    struct.pack_into("<Q", v, 24, 2**60)
    f["huge_string_length.gguf"] = bytes(v)
    # Element count of 2^60 in a metadata array.
    arr = g.build_gguf(BASE_KV + [("x", g.ARRAY, (g.U8, [1]))], BASE_T)
    i = arr.index(b"\x01\x00\x00\x00\x00\x00\x00\x00\x01", 24)  # u64 count 1 followed by the one u8 item
    arr = bytearray(arr)
    struct.pack_into("<Q", arr, i, 2**60)
    f["huge_array_length.gguf"] = bytes(arr)
    u = bytearray(g.build_gguf([("general.architecture", g.U32, 1)], BASE_T))
    struct.pack_into("<I", u, 24 + 8 + len("general.architecture"), 77)
    f["unknown_value_type.gguf"] = bytes(u)
    # Dimensions whose product overflows 64 bits, and too many dimensions.
    f["dims_overflow.gguf"] = g.build_gguf(BASE_KV, [("a", [2**40, 2**40], g.T_F32, b"\0" * 32)])
    f["too_many_dims.gguf"] = g.build_gguf(BASE_KV, [("a", [1] * 9, g.T_F32, b"\0" * 4)])
    # general.alignment of 0 (division by zero when aligning) and not a power of two.
    f["alignment_zero.gguf"] = g.build_gguf(BASE_KV + [("general.alignment", g.U32, 0)], BASE_T)
    f["alignment_3.gguf"] = g.build_gguf(BASE_KV + [("general.alignment", g.U32, 3)], BASE_T, alignment=3)
    # Two tensors with the same name; a repeated metadata key.
    f["duplicate_tensor_name.gguf"] = g.build_gguf(BASE_KV, [BASE_T[0], ("a",) + BASE_T[1][1:]])
    f["duplicate_key.gguf"] = g.build_gguf(BASE_KV + [("general.name", g.STRING, "again")], BASE_T)
    # Quantized tensor whose row is not a whole number of blocks.
    f["partial_block.gguf"] = _partial_block()
    # Array nesting deep enough to overflow a recursive parser's stack (about 1.2 MB).
    f["deep_nesting.gguf"] = g.build_gguf(BASE_KV + [("deep", g.ARRAY, nested(100000))], BASE_T)
    return f


def _partial_block():
    # A Q8_0 tensor of 16 elements (a block is 32): written as F32 [16] (64 bytes), type id patched.
    return g.build_gguf(BASE_KV, [("q", [16], g.T_F32, b"\0" * 64)], types=[g.T_Q8_0])


def truncation_points(data):
    """Offsets that cut SRC inside its fixed header, its metadata, its tensor infos and its last tensor."""
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    alignment = 32

    def skip_value(t, pos):
        if t == g.STRING:
            (n,) = struct.unpack_from("<Q", data, pos)
            return pos + 8 + n
        if t == g.ARRAY:
            et, n = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if et in g._SCALAR:
                return pos + n * struct.calcsize(g._SCALAR[et])
            for _ in range(n):
                pos = skip_value(et, pos)
            return pos
        return pos + struct.calcsize(g._SCALAR[t])

    for _ in range(n_kv):
        (klen,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8:pos + 8 + klen]
        (t,) = struct.unpack_from("<I", data, pos + 8 + klen)
        vpos = pos + 12 + klen
        if key == b"general.alignment":
            alignment = struct.unpack_from(g._SCALAR[t], data, vpos)[0]
        pos = skip_value(t, vpos)
    kv_end = pos
    offsets = []
    for _ in range(n_tensors):
        (nlen,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + nlen
        (nd,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * nd
        _, off = struct.unpack_from("<IQ", data, pos)
        pos += 12
        offsets.append(off)
    info_end = pos
    data_start = g.align_up(info_end, alignment)
    points = {"header": 16, "kv": 24 + (kv_end - 24) // 2}
    if n_tensors:
        points["tensor_info"] = kv_end + (info_end - kv_end) // 2
        points["data"] = data_start + max(offsets) + 1  # one byte into the last tensor's data
    return points


def main():
    if sys.argv[1] == "--truncate":
        src, prefix = sys.argv[2], sys.argv[3]
        with open(src, "rb") as fh:
            data = fh.read()
        for name, n in truncation_points(data).items():
            assert 0 < n < len(data), (name, n, len(data))
            with open("%s.%s.gguf" % (prefix, name), "wb") as fh:
                fh.write(data[:n])
        return
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for name, data in sorted(files().items()):
        with open(os.path.join(out, name), "wb") as fh:
            fh.write(data)


if __name__ == "__main__":
    main()
