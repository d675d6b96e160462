#!/usr/bin/python3
"""Writes small GGUF v3 files: the fuzzers' seed corpus, and (as a module) deliberately broken files for
the CLI tests (tests/cli/make_bad_gguf.py). Standard library only.

    /usr/bin/python3 tests/fuzz/make_seed_corpus.py [OUT_DIR]     (default: tests/fuzz/corpus)

writes OUT_DIR/gguf/*.gguf and OUT_DIR/tokenizer/*.txt. The output is deterministic; re-run it after
changing this file and commit the result.

GGUF v3 layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), all little-endian:
  u32 magic "GGUF", u32 version, u64 n_tensors, u64 n_kv,
  n_kv x (string key, u32 type, value), n_tensors x (string name, u32 n_dims, u64 dims[n_dims],
  u32 ggml_type, u64 offset), padding to the alignment, then the data section (each tensor's offset is
  relative to its start and a multiple of the alignment).
  string = u64 length + bytes; array = u32 element type, u64 count, elements.
"""
import os
import struct
import sys

# Metadata value types.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
           U64: "<Q", I64: "<q", F64: "<d"}

# GGML tensor types used here: id -> (block size in elements, bytes per block).
T_F32, T_F16, T_Q4_0, T_Q8_0, T_Q4_K, T_I8, T_I16, T_I32, T_BF16 = 0, 1, 2, 8, 12, 24, 25, 26, 30
TYPE_BLOCK = {T_F32: (1, 4), T_F16: (1, 2), T_Q4_0: (32, 18), T_Q8_0: (32, 34), T_Q4_K: (256, 144),
              T_I8: (1, 1), T_I16: (1, 2), T_I32: (1, 4), T_BF16: (1, 2)}


def gguf_string(s):
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


class Raw(bytes):
    """An already encoded value (written as is after its type)."""


def encode_value(vtype, value):
    """value: a Python scalar/str, or for ARRAY a pair (element_type, [items]) where nested-array items
    are themselves such pairs, or Raw bytes."""
    if isinstance(value, Raw):
        return bytes(value)
    if vtype == STRING:
        return gguf_string(value)
    if vtype == ARRAY:
        etype, items = value
        out = struct.pack("<IQ", etype, len(items))
        for it in items:
            out += encode_value(etype, it)
        return out
    return struct.pack(_SCALAR[vtype], value)


def tensor_nbytes(ttype, dims):
    n = 1
    for d in dims:
        n *= d
    bs, bb = TYPE_BLOCK[ttype]
    assert n % bs == 0, (ttype, dims)
    return n // bs * bb


def align_up(x, a):
    return (x + a - 1) // a * a


def build_gguf(kvs, tensors, *, alignment=32, magic=b"GGUF", version=3, n_tensors=None, n_kv=None,
               offsets=None, types=None):
    """kvs: [(key, vtype, value)]; tensors: [(name, dims, ggml_type, data_bytes)]. The keyword overrides
    write inconsistent headers on purpose (for the CLI bad-input tests)."""
    out = bytearray()
    out += magic + struct.pack("<I", version)
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors,
                       len(kvs) if n_kv is None else n_kv)
    for key, vtype, value in kvs:
        out += gguf_string(key) + struct.pack("<I", vtype) + encode_value(vtype, value)
    offset = 0
    layout = []
    for i, (name, dims, ttype, data) in enumerate(tensors):
        offset = align_up(offset, alignment)
        layout.append(offset)
        off = offset if offsets is None or offsets[i] is None else offsets[i]
        tt = ttype if types is None or types[i] is None else types[i]
        out += gguf_string(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", tt, off)
        offset += len(data)
    out += b"\0" * (align_up(len(out), alignment) - len(out))
    base = len(out)
    for (name, dims, ttype, data), off in zip(tensors, layout):
        out += b"\0" * (base + off - len(out))
        out += data
    return bytes(out)


def f32_bytes(values):
    return b"".join(struct.pack("<f", v) for v in values)


def f16_bytes(values):
    return b"".join(struct.pack("<e", v) for v in values)


def pattern_bytes(n, seed=1):
    x = seed
    out = bytearray()
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append((x >> 16) & 0xFF)
    return bytes(out)


def all_types_file():
    """Every metadata value type, arrays of each, nested arrays, and two small F32/F16 tensors."""
    kvs = [
        ("general.architecture", STRING, "llama"),
        ("general.name", STRING, "seed \u00e9\u4e2d\U0001F600"),
        ("general.alignment", U32, 32),
        ("test.u8", U8, 200),
        ("test.i8", I8, -100),
        ("test.u16", U16, 65000),
        ("test.i16", I16, -32000),
        ("test.u32", U32, 4000000000),
        ("test.i32", I32, -2000000000),
        ("test.f32", F32, 1.5),
        ("test.bool", BOOL, True),
        ("test.string", STRING, "hello\nworld"),
        ("test.empty_string", STRING, ""),
        ("test.u64", U64, 2**63 + 5),
        ("test.i64", I64, -(2**62)),
        ("test.f64", F64, -2.25),
        ("test.arr.u8", ARRAY, (U8, [0, 1, 255])),
        ("test.arr.i8", ARRAY, (I8, [-128, 0, 127])),
        ("test.arr.u16", ARRAY, (U16, [1, 65535])),
        ("test.arr.i16", ARRAY, (I16, [-1, 1])),
        ("test.arr.u32", ARRAY, (U32, [7, 8, 9])),
        ("test.arr.i32", ARRAY, (I32, [-7, 0, 7, 2**31 - 1])),
        ("test.arr.f32", ARRAY, (F32, [0.0, -1.0, 3.25])),
        ("test.arr.bool", ARRAY, (BOOL, [True, False])),
        ("test.arr.string", ARRAY, (STRING, ["a", "", "\u00fc\u00df", "<|endoftext|>"])),
        ("test.arr.u64", ARRAY, (U64, [0, 2**64 - 1])),
        ("test.arr.i64", ARRAY, (I64, [-(2**63), 2**63 - 1])),
        ("test.arr.f64", ARRAY, (F64, [1e300, -1e-300])),
        ("test.arr.empty", ARRAY, (I32, [])),
        ("test.arr.nested", ARRAY, (ARRAY, [(I32, [1, 2]), (I32, []), (I32, [3])])),
        ("test.arr.nested2", ARRAY, (ARRAY, [(ARRAY, [(STRING, ["x", "y"])]), (ARRAY, [])])),
    ]
    tensors = [
        ("weight.f32", [4, 2], T_F32, f32_bytes([0.5 * i - 1 for i in range(8)])),
        ("weight.f16", [8], T_F16, f16_bytes([0.25 * i for i in range(8)])),
    ]
    return build_gguf(kvs, tensors)


def seed_files():
    files = {}
    files["01_minimal.gguf"] = build_gguf([], [])
    files["02_all_types.gguf"] = all_types_file()
    files["03_align64.gguf"] = build_gguf(
        [("general.architecture", STRING, "llama"), ("general.alignment", U32, 64)],
        [("a", [3], T_F32, f32_bytes([1, 2, 3])),
         ("b", [2, 2], T_BF16, pattern_bytes(8, 3)),
         ("c", [5], T_I32, struct.pack("<5i", 1, -2, 3, -4, 5)),
         ("d", [1, 2, 1, 2], T_F32, f32_bytes([9, 8, 7, 6]))],
        alignment=64)
    files["04_quant.gguf"] = build_gguf(
        [("general.architecture", STRING, "llama"), ("general.file_type", U32, 7)],
        [("q8", [32, 2], T_Q8_0, pattern_bytes(68, 5)),
         ("q4", [32], T_Q4_0, pattern_bytes(18, 6)),
         ("q4k", [256], T_Q4_K, pattern_bytes(144, 7)),
         ("i8", [3], T_I8, b"\x01\xff\x7f"),
         ("i16", [2], T_I16, struct.pack("<2h", -5, 5))])
    gpt2_tokens = ["!", "\"", "a", "b", "c", "\u0120", "\u0120a", "ab", "abc", "\u0120ab", "<|endoftext|>"]
    files["05_gpt2_tokenizer.gguf"] = build_gguf(
        [("general.architecture", STRING, "gpt2"),
         ("tokenizer.ggml.model", STRING, "gpt2"),
         ("tokenizer.ggml.pre", STRING, "gpt-2"),
         ("tokenizer.ggml.tokens", ARRAY, (STRING, gpt2_tokens)),
         ("tokenizer.ggml.token_type", ARRAY, (I32, [1] * (len(gpt2_tokens) - 1) + [3])),
         ("tokenizer.ggml.merges", ARRAY, (STRING, ["\u0120 a", "a b", "ab c", "\u0120 ab"])),
         ("tokenizer.ggml.bos_token_id", U32, len(gpt2_tokens) - 1),
         ("tokenizer.ggml.eos_token_id", U32, len(gpt2_tokens) - 1)],
        [])
    sp_tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + ["\u2581", "\u2581a", "b"]
    files["06_llama_tokenizer.gguf"] = build_gguf(
        [("general.architecture", STRING, "llama"),
         ("llama.context_length", U32, 64),
         ("llama.embedding_length", U32, 8),
         ("llama.block_count", U32, 1),
         ("llama.attention.head_count", U32, 2),
         ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
         ("tokenizer.ggml.model", STRING, "llama"),
         ("tokenizer.ggml.tokens", ARRAY, (STRING, sp_tokens)),
         ("tokenizer.ggml.scores", ARRAY, (F32, [0.0] * 259 + [-1.0, -2.0, -3.0])),
         ("tokenizer.ggml.token_type", ARRAY, (I32, [2, 3, 3] + [6] * 256 + [1, 1, 1])),
         ("tokenizer.ggml.unknown_token_id", U32, 0),
         ("tokenizer.ggml.bos_token_id", U32, 1),
         ("tokenizer.ggml.eos_token_id", U32, 2),
         ("tokenizer.ggml.add_bos_token", BOOL, True)],
        [("token_embd.weight", [8, 4], T_F32, f32_bytes([0.125 * i for i in range(32)]))])
    # Truncated copies of the richest file: inside the header, a key, a value, the tensor infos, the data.
    full = files["02_all_types.gguf"]
    for n in (6, 20, 40, 200, len(full) // 2, len(full) - 40, len(full) - 1):
        files["10_truncated_%04d.gguf" % n] = full[:n]
    return files


TOKENIZER_SEEDS = {
    "01_ascii.txt": b"Once upon a time, there was a little girl named Lily.\n",
    "02_whitespace.txt": b"  a\t\tb \n\n  c   \r\n",
    "03_unicode.txt": "caf\u00e9 \u4e2d\u6587 \U0001F600 na\u00efve \u0645\u0631\u062d\u0628\u0627".encode("utf-8"),
    "04_special.txt": b"Hello<|endoftext|>world <|endoftext|>",
    "05_numbers_code.txt": b"x = 12345 + 0.5e-3; // 'quote' \"dq\" don't I'll",
    "06_invalid_utf8.txt": b"ab\xff\xfe\xc3(\xe2\x82",
}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "corpus")
    for sub, files in (("gguf", seed_files()), ("tokenizer", TOKENIZER_SEEDS)):
        d = os.path.join(out, sub)
        os.makedirs(d, exist_ok=True)
        for name, data in sorted(files.items()):
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(out) for f in fs)
    print("wrote %s (%d bytes)" % (out, total))


if __name__ == "__main__":
    main()
