#!/usr/bin/python3
"""Writes the cache file conformance corpus (formats/kvcache.md) with h5py.

    HDF5_PLUGIN_PATH=build/lib/hdf5-plugins /usr/bin/python3 tests/tools/make_kvcache_corpus.py

writes tests/data/kvcache/{good,broken}/NNNN_*.kvc, README.md (each file and the expected
result) and expected.tsv (the same, for tests/cli/kvinspect/corpus.sh). The files are written by
h5py, not by kvtools, so that the tests prove the reader accepts what another HDF5 writer makes
from the specification. Values come from a seeded generator: rerunning gives the same tensors.

zstd (filter 32015) needs a filter plugin: hdf5plugin's own where it ships one (PyPI wheels), or
kvtools' libkvh5zstd.so (Debian's python3-hdf5plugin ships none) through HDF5_PLUGIN_PATH.
"""
import hashlib
import os
import sys
import zlib

import h5py
import numpy as np

try:
    import hdf5plugin  # noqa: F401  registers its filters where it has binaries
except ImportError:
    pass

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "data", "kvcache")
ZSTD = 32015

LAYERS, HEADS, DIM = 2, 2, 4


def sha(text):
    return hashlib.sha256(text.encode()).hexdigest()


MODEL = {
    "fingerprint": sha("corpus model"),
    "name": "corpus/tiny-llama",
    "architecture": "LlamaForCausalLM",
    "num_layers": LAYERS,
    "num_kv_heads": HEADS,
    "head_dim": DIM,
    "rope_layout": "half_split",
    "rope_theta": 10000.0,
    "rope_scaling": "",
    "tokenizer_fingerprint": sha("corpus tokenizer"),
}
PROVENANCE = {
    "tool": "make_kvcache_corpus.py",
    "version": "1",
    "command_line": "tests/tools/make_kvcache_corpus.py",
}


def to_bf16(values):
    """float32 -> bfloat16 bits, rounding to nearest even."""
    bits = values.astype("<f4").view("<u4").astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")


def packet(ident, length, seed, logical=None, positions=None, tokens=None, adapter="",
           header=0, trailer=0):
    rng = np.random.default_rng(seed)
    return {
        "id": ident,
        "text_sha256": sha("text of " + ident),
        "token_ids": np.array(tokens if tokens is not None else rng.integers(0, 512, length),
                              dtype="<i4"),
        "positions": np.array(positions if positions is not None else range(length), dtype="<i8"),
        "logical_length": logical if logical is not None else length,
        "adapter_fingerprint": adapter,
        "header_tokens": header,
        "trailer_tokens": trailer,
        "keys": rng.standard_normal((LAYERS, HEADS, length, DIM)).astype("<f4"),
        "values": rng.standard_normal((LAYERS, HEADS, length, DIM)).astype("<f4"),
    }


def strings(values):
    return np.array(values, dtype=h5py.string_dtype())


def create_file(path, libver):
    """h5py.File(path, "w", libver=libver), without modification times, so that rerunning the
    script rewrites identical bytes."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    bound = {"earliest": h5py.h5f.LIBVER_EARLIEST, "v110": h5py.h5f.LIBVER_V110}[libver]
    fapl.set_libver_bounds(bound, h5py.h5f.LIBVER_V110)
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_obj_track_times(False)
    return h5py.File(h5py.h5f.create(path.encode(), h5py.h5f.ACC_TRUNC, fapl=fapl, fcpl=fcpl))


def create_group(parent, name):
    gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    h5py.h5g.create(parent.id, name.encode(), gcpl=gcpl)
    return parent[name]


def write_store(path, packets, dtype="f32", filters="zstd", chunk_tokens=4, libver="v110",
                root=None, model=None, provenance=None, hook=None):
    """Writes a store the way the specification describes; `root`, `model` and `provenance`
    override attributes (value None deletes one); `hook(file)` runs last, before 'complete'."""
    with create_file(path, libver) as f:
        attributes = {"format": "kvtools-kvcache", "format_version": "1.0", "dtype": dtype,
                      "keys_after_rope": 1}
        attributes.update(root or {})
        for name, value in attributes.items():
            if value is not None:
                f.attrs[name] = value
        for group_name, base, override in (("model", MODEL, model),
                                           ("provenance", PROVENANCE, provenance)):
            group = create_group(f, group_name)
            values = dict(base)
            values.update(override or {})
            for name, value in values.items():
                if value is not None:
                    group.attrs[name] = value
        create_group(f, "packets")
        for ordinal, p in enumerate(packets):
            group = create_group(f["packets"], "%08d" % ordinal)
            for name in ("id", "text_sha256", "logical_length", "adapter_fingerprint",
                         "header_tokens", "trailer_tokens"):
                group.attrs[name] = p[name]
            stored = len(p["token_ids"])
            group.attrs["stored_length"] = stored
            options = {}
            if filters and stored > 0:
                options["fletcher32"] = True
                if filters == "zstd":
                    options.update(compression=ZSTD, compression_opts=(3,), shuffle=True)
                elif filters == "gzip":
                    options.update(compression="gzip", compression_opts=4)
            for name in ("token_ids", "positions"):
                chunks = (stored,) if options else None
                group.create_dataset(name, data=p[name], chunks=chunks, **options)
            for name in ("keys", "values"):
                data = p[name]
                if dtype == "bf16":
                    data = to_bf16(data)
                elif dtype == "f16":
                    data = data.astype("<f2")
                elif dtype == "f32-big-endian":
                    data = data.astype(">f4")
                chunks = (1, 1, min(chunk_tokens, stored), DIM) if options else None
                dataset = group.create_dataset(name, data=data, chunks=chunks, **options)
                if dtype == "bf16":
                    dataset.attrs["dtype"] = "bf16"
        index = create_group(f, "packet_index")
        index.create_dataset("id", data=strings([p["id"] for p in packets]))
        index.create_dataset("text_sha256", data=strings([p["text_sha256"] for p in packets]))
        index.create_dataset("adapter_fingerprint",
                             data=strings([p["adapter_fingerprint"] for p in packets]))
        for name in ("logical_length", "header_tokens", "trailer_tokens"):
            index.create_dataset(name, data=np.array([p[name] for p in packets], dtype="<i8"))
        index.create_dataset("stored_length",
                             data=np.array([len(p["token_ids"]) for p in packets], dtype="<i8"))
        if hook:
            hook(f)
        if "complete" not in (root or {}):
            f.attrs["complete"] = 1
    if dtype == "f32-big-endian":
        with h5py.File(path, "r+") as f:
            f.attrs["dtype"] = "f32"


def link_name(ident):
    """The name of a packet's link under /packet_ids (formats/kvcache.md 6.1)."""
    if ident == ".":
        return "%2E"
    return "".join("%%%02X" % ord(c) if c in "%/" else c for c in ident)


def add_packet_ids(f, packets, links=None):
    """/packet_ids (1.6): a soft link per packet, named by its id, to its group; `links` (name
    -> target) replaces them."""
    group = create_group(f, "packet_ids")
    if links is None:
        links = {link_name(p["id"]): "/packets/%08d" % i for i, p in enumerate(packets)}
    for name, target in links.items():
        group[name] = h5py.SoftLink(target)


def add_index(f, ordinal=0, method="mdci", page_sizes=None, layers=None, declare=True):
    """An IceCache index (formats/kvcache.md, 6.5) for a small packet: one segment, one level
    (fewer than 100 tokens), the tokens in pages of 16 in projection order; over `layers` only
    (since 1.5, feature index-layers, listed unless `declare` is false) when given."""
    group = f["packets/%08d" % ordinal]
    covered = list(range(LAYERS)) if layers is None else list(layers)
    count = int(group.attrs["stored_length"])
    keys = group["keys"][...].astype("<f4")
    index = create_group(group, "index")
    index.attrs["method"] = method
    index.attrs["page_size"] = 16
    index.attrs["promotion_first"] = 0.01
    index.attrs["promotion_rest"] = 0.2
    direction = np.linspace(1.0, 2.0, DIM + 1).astype("<f4")
    direction /= np.linalg.norm(direction)
    index.create_dataset("projection", data=direction)
    index.create_dataset("segments", data=np.array([[0, count, 0]], dtype="<i8"))
    rows = len(covered)
    if layers is not None:
        index.create_dataset("layers", data=np.array(covered, dtype="<i8"))
        if declare:
            f.attrs.create("required_features", ["index-layers"], dtype=h5py.string_dtype())
    norm = 2.0 * float((keys.astype(np.float64) ** 2).sum(-1).max()) + 1.0
    index.create_dataset("max_squared_norm", data=np.full((rows, HEADS, 1), norm))
    index.create_dataset("levels", data=np.zeros((rows, HEADS, count), dtype="<i1"))
    index.create_dataset("parents", data=np.full((rows, HEADS, count), -1, dtype="<i4"))
    sizes = page_sizes or [min(16, count - start) for start in range(0, count, 16)]
    index.create_dataset("page_counts", data=np.full((rows, HEADS, 1), len(sizes), dtype="<i4"))
    index.create_dataset("page_sizes",
                         data=np.tile(np.array(sizes, dtype="<i4"), (rows, HEADS, 1)))
    tokens = np.zeros((rows, HEADS, count), dtype="<i4")
    for row, layer in enumerate(covered):
        for head in range(HEADS):
            k = keys[layer, head].astype(np.float64)
            tail = np.sqrt(np.maximum(0.0, norm - (k ** 2).sum(-1)))
            projection = k @ direction[:DIM] + tail * direction[DIM]
            tokens[row, head] = np.argsort(projection, kind="stable")
    index.create_dataset("page_tokens", data=tokens)


def add_ragged(f, ordinal, lengths, head_positions, declare=True):
    """Per-head kept tokens (formats/kvcache.md, 6.3) for packet `ordinal`: lengths [L][H],
    head_positions [L][H][used]; padding slots get 0."""
    group = f["packets/%08d" % ordinal]
    slots = int(group.attrs["stored_length"])
    table = np.zeros((LAYERS, HEADS, slots), dtype="<i8")
    for layer in range(LAYERS):
        for head in range(HEADS):
            used = head_positions[layer][head]
            table[layer, head, :len(used)] = used
    group.create_dataset("head_lengths", data=np.array(lengths, dtype="<i8"))
    group.create_dataset("head_positions", data=table, chunks=(1, 1, slots), fletcher32=True)
    if declare:
        f.attrs.create("required_features", ["ragged-heads"], dtype=h5py.string_dtype())


# A packet of 10 tokens compressed per head to at most 4 slots; layer 1, kv-head 1 keeps only 3
# (its fourth slot is padding). positions[s] is the largest position any head uses slot s for.
RAGGED_LENGTHS = [[4, 4], [4, 3]]
RAGGED_POSITIONS = [[[0, 2, 5, 9], [1, 2, 6, 8]], [[0, 3, 4, 7], [0, 1, 2]]]
RAGGED_SLOT_POSITIONS = [1, 3, 6, 9]


def quantize_packet(f, ordinal, bits, group_size, residual, declare=True):
    """Replaces packet `ordinal`'s keys and values by the quantized group of formats/kvcache.md
    6.6, with codes, scales and offsets chosen so that every value is exactly known: element e
    (row-major over [L, H, Q, D]) has code e % 2**bits, scale 0.25 (keys) or 0.5 (values) and
    offset -1; residual slot values are 100 + their row-major index."""
    group = f["packets/%08d" % ordinal]
    slots = int(group.attrs["stored_length"])
    kept = slots - min(residual, slots)
    del group["keys"], group["values"]
    q = create_group(group, "quantized")
    q.attrs["bits"], q.attrs["group_size"], q.attrs["residual_tokens"] = bits, group_size, residual
    for prefix, scale in (("key_", 0.25), ("value_", 0.5)):
        codes = (np.arange(LAYERS * HEADS * kept * DIM) % (1 << bits)).reshape(LAYERS, HEADS, kept, DIM)
        if bits == 4:  # two per byte, the even dimension in the low nibble
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        q.create_dataset(prefix + "codes", data=codes.astype("u1"))
        shape = (LAYERS, HEADS, kept, DIM // group_size)
        q.create_dataset(prefix + "scales", data=np.full(shape, scale, dtype="<f4"))
        q.create_dataset(prefix + "offsets", data=np.full(shape, -1.0, dtype="<f4"))
        rest = slots - kept
        q.create_dataset(prefix + "residual",
                         data=(100 + np.arange(LAYERS * HEADS * rest * DIM)).reshape(
                             LAYERS, HEADS, rest, DIM).astype("<f4"))
    if declare:
        f.attrs.create("required_features", ["quantized-kv"], dtype=h5py.string_dtype())


def add_adapter(f, header=2, trailer=1, hidden=6, seed=21, fingerprint=None):
    """A KV Packet adapter (section 6.7); its fingerprint computed as the spec says."""
    rng = np.random.default_rng(seed)
    head = rng.normal(0, 0.5, (header, hidden)).astype("<f4")
    tail = rng.normal(0, 0.5, (trailer, hidden)).astype("<f4")
    digest = hashlib.sha256()
    digest.update(b"kvtools-adapter-v1\n%d %d %d\n" % (header, trailer, hidden))
    digest.update(head.tobytes())
    digest.update(tail.tobytes())
    group = create_group(f, "adapter")
    group.attrs["fingerprint"] = fingerprint or digest.hexdigest()
    group.attrs["header_tokens"] = header
    group.attrs["trailer_tokens"] = trailer
    group.attrs["hidden_size"] = hidden
    group.attrs["init_mean"] = 0.0
    group.attrs["init_std"] = 0.5
    group.attrs["training"] = ""
    group.create_dataset("header", data=head)
    group.create_dataset("trailer", data=tail)
    return digest.hexdigest()


def flip_byte_in_chunk(path, dataset_path, at=None):
    """Flips one byte of the first stored chunk of a dataset, where h5py says it lies: in the
    middle (by default), so that its Fletcher32 checksum no longer matches, or at `at`."""
    with h5py.File(path, "r") as f:
        info = f[dataset_path].id.get_chunk_info(0)
        offset = info.byte_offset + (info.size // 2 if at is None else at)
    with open(path, "r+b") as stream:
        stream.seek(offset)
        byte = stream.read(1)[0]
        stream.seek(offset)
        stream.write(bytes([byte ^ 0xFF]))


def hdf5_fletcher32(data):
    """HDF5's Fletcher32 (H5_checksum_fletcher32): big-endian 16-bit words, sums folded every
    360 words and once more at the end."""
    def fold(value):
        return (value & 0xFFFF) + (value >> 16)
    sum1 = sum2 = 0
    words = [(data[i] << 8) | data[i + 1] for i in range(0, len(data) - 1, 2)]
    if len(data) % 2:
        words.append(data[-1] << 8)
    for start in range(0, len(words), 360):
        for word in words[start:start + 360]:
            sum1 += word
            sum2 += sum1
        sum1, sum2 = fold(sum1), fold(sum2)
    return (fold(sum2) << 16) | fold(sum1)


def replace_positions(path, ordinal, stored_chunk=None, **filters):
    """Rewrites packet `ordinal`'s positions as one chunk with `filters` (h5py's keywords)
    whose stored bytes are `stored_chunk(shuffled positions)`, written as given; without
    `stored_chunk`, the filters write it."""
    with h5py.File(path, "r+") as f:
        group = f["packets/%08d" % ordinal]
        positions = group["positions"][...].astype("<i8")
        del group["positions"]
        dataset = group.create_dataset("positions", shape=positions.shape, dtype="<i8",
                                       chunks=positions.shape, **filters)
        if stored_chunk is None:
            dataset[...] = positions
            return
        shuffled = positions.view(np.uint8).reshape(-1, 8).T.tobytes()
        dataset.id.write_direct_chunk((0,), stored_chunk(shuffled))


def unwrite(path, ordinal, name):
    """Recreates packet `ordinal`'s dataset `name` with its shape, type and filters but no chunk
    written (HDF5 would read its fill value, zeros)."""
    with h5py.File(path, "r+") as f:
        group = f["packets/%08d" % ordinal]
        old = group[name]
        shape, dtype, chunks = old.shape, old.dtype, old.chunks
        del group[name]
        group.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks, fletcher32=True,
                             compression=ZSTD, compression_opts=(3,), shuffle=True)


def with_fletcher32(data):
    return data + hdf5_fletcher32(data).to_bytes(4, "little")


def two_packets(**kwargs):
    return [packet("doc-1", 5, 1, **kwargs), packet("doc-2", 3, 2)]


def main():
    probe = h5py.File("probe", "w", driver="core", backing_store=False)
    try:
        probe.create_dataset("x", data=np.zeros(4), chunks=(4,), compression=ZSTD)
    except ValueError:
        sys.exit("no zstd filter (32015) in this HDF5: set HDF5_PLUGIN_PATH to a directory with "
                 "one, e.g. build/lib/hdf5-plugins")
    probe.close()
    for sub in ("good", "broken"):
        os.makedirs(os.path.join(OUT, sub), exist_ok=True)
        for old in os.listdir(os.path.join(OUT, sub)):
            os.remove(os.path.join(OUT, sub, old))

    cases = []  # (relative path, description, expected stderr glob or "" for good)

    def good(name, description, packets, **kwargs):
        write_store(os.path.join(OUT, "good", name + ".kvc"), packets, **kwargs)
        cases.append(("good/%s.kvc" % name, description, ""))

    def broken(name, description, expected, packets=None, after=None, **kwargs):
        path = os.path.join(OUT, "broken", name + ".kvc")
        write_store(path, packets if packets is not None else two_packets(), **kwargs)
        if after:
            after(path)
        cases.append(("broken/%s.kvc" % name, description, expected))

    # ---- good, simple to complex
    good("0001_minimal", "one packet of 3 tokens, f32, contiguous datasets, no filters",
         [packet("only", 3, 1)], filters=None)
    good("0002_f32_zstd", "two packets, f32, chunked, shuffle + zstd + Fletcher32",
         two_packets())
    good("0003_bf16", "bf16 as uint16 with the dtype attribute", two_packets(), dtype="bf16")
    good("0004_f16", "f16 as an IEEE half float type (numpy float16)", two_packets(), dtype="f16")
    good("0005_no_packets", "a store with no packets (empty index datasets)", [])
    good("0006_compressed_and_adapter",
         "a packet that kept 3 of 10 tokens (gaps in positions), and a KV Packet adapter "
         "packet (header and trailer soft tokens with id -1)",
         [packet("pruned", 3, 3, logical=10, positions=[0, 4, 9]),
          packet("wrapped", 6, 4, tokens=[-1, -1, 17, 18, -1, -1], adapter=sha("adapter"),
                 header=2, trailer=2)])
    good("0007_gzip_big_endian_earliest",
         "deflate instead of zstd, big-endian float32 keys, HDF5's earliest file format "
         "(h5py's default)",
         two_packets(), dtype="f32-big-endian", filters="gzip", libver="earliest")

    # Fixed-length ASCII strings, 32-bit integers, an integer rope_theta, optional ones absent.
    good("0008_loose_types_optional_absent",
         "fixed-length ASCII strings, 32-bit integers, integer rope_theta; the optional model "
         "name, rope_scaling and created absent",
         two_packets(),
         root={"format": np.bytes_("kvtools-kvcache"), "format_version": np.bytes_("1.0")},
         model={"name": None, "rope_scaling": None, "num_layers": np.int32(LAYERS),
                "rope_theta": np.int32(10000), "architecture": np.bytes_("LlamaForCausalLM")})

    def extensions(f):
        f.attrs["x_experiment"] = "ignored"
        f.attrs["some_future_attribute"] = 42
        f["packets/00000000"].attrs["x_note"] = "ignored"
        create_group(f, "x_scratch").create_dataset("junk", data=np.arange(3))
        f["packets/00000001"].create_dataset("x_extra", data=np.arange(3))
    good("0009_future_minor_and_extensions",
         "format_version 1.8 with unknown attributes, x_ attributes, datasets and groups, "
         "which readers ignore",
         two_packets(), root={"format_version": "1.8"}, hook=extensions)
    ids = ["doc-%02d" % i for i in range(9)] + ["naïve ünïcode", "with/slash", "日本語"]
    good("0010_many_packets",
         "12 packets, Unicode ids and a slash, lengths 1 to 20, several chunks per packet",
         [packet(ident, 1 + (7 * i) % 20, 100 + i) for i, ident in enumerate(ids)],
         chunk_tokens=8, model={"rope_scaling": '{"rope_type":"llama3","factor":8.0}'})

    good("0011_indexed",
         "format_version 1.1: an IceCache index in one packet (18 tokens, two pages), and one of "
         "an unknown method, which readers ignore",
         [packet("indexed", 18, 11), packet("other", 3, 12)], root={"format_version": "1.1"},
         hook=lambda f: (add_index(f, 0), add_index(f, 1, method="x-future")))

    good("0012_ragged_heads",
         "format_version 1.2 with feature ragged-heads: a packet keeping 4 of 10 tokens per "
         "(layer, kv-head), different ones in each head, one head with a padding slot",
         [packet("ragged", 4, 13, logical=10, positions=RAGGED_SLOT_POSITIONS),
          packet("plain", 3, 14)],
         root={"format_version": "1.2"},
         hook=lambda f: add_ragged(f, 0, RAGGED_LENGTHS, RAGGED_POSITIONS))

    good("0013_quantized",
         "format_version 1.3 with feature quantized-kv: packet 'q8' as 8-bit codes (group 4, no "
         "residual), 'q4' as 4-bit codes (group 2) with its last 2 slots unquantised; every "
         "value exactly known (see quantize_packet)",
         [packet("q8", 3, 15), packet("q4", 5, 16), packet("plain", 2, 17)],
         root={"format_version": "1.3"},
         hook=lambda f: (quantize_packet(f, 0, 8, 4, 0, declare=False),
                         quantize_packet(f, 1, 4, 2, 2)))

    good("0014_adapter",
         "format_version 1.4: an adapter file (2 + 1 soft tokens of width 6, no packets) whose "
         "fingerprint follows section 6.7's recipe",
         [], root={"format_version": "1.4"}, hook=lambda f: add_adapter(f))

    good("0015_index_layers",
         "format_version 1.5 with feature index-layers: an IceCache index over layer 1 only "
         "(kvindex --dense-layers 1), 18 tokens in two pages",
         [packet("indexed", 18, 11)], root={"format_version": "1.5"},
         hook=lambda f: add_index(f, 0, layers=[1]))

    linked = [packet("doc-%02d" % i, 1 + i % 5, 200 + i) for i in range(9)] + [
        packet("with/slash", 2, 210), packet("100%", 3, 211), packet(".", 1, 212)]
    good("0016_packet_ids",
         "format_version 1.6: /packet_ids, a soft link per packet named by its id ('/' written "
         "%2F, '%' written %25, the id '.' written %2E) to its group",
         linked, root={"format_version": "1.6"},
         hook=lambda f: add_packet_ids(f, linked))

    one_mib = [packet("doc-1", 40, 300), packet("doc-2", 7, 301)]
    good("0017_chunks_1mib",
         "format_version 1.7: tensor_layout chunks-1mib, keys and values in chunks of 1 MiB of "
         "one plane (here the whole plane: 40 and 7 tokens), shuffle + zstd + Fletcher32",
         one_mib, root={"format_version": "1.7", "tensor_layout": "chunks-1mib"},
         chunk_tokens=1 << 16)
    good("0018_chunks_1mib_uncompressed",
         "format_version 1.7: tensor_layout chunks-1mib without zstd: Fletcher32 alone",
         one_mib, root={"format_version": "1.7", "tensor_layout": "chunks-1mib"},
         chunk_tokens=1 << 16, filters="fletcher32")

    # ---- broken
    def truncate(path):
        size = os.path.getsize(path)
        with open(path, "r+b") as stream:
            stream.truncate(size // 2)
    broken("0001_truncated", "the second half of the file is missing",
           "*: cannot open the HDF5 file: truncated file*", after=truncate)

    def text(path):
        with open(path, "w") as stream:
            stream.write("this is not a cache file\n")
    broken("0002_not_hdf5", "a text file", "*: not an HDF5 file", after=text)
    broken("0003_bad_format_name", "format = 'kvtools-kvcachex'",
           "*: not a kvtools cache (format is 'kvtools-kvcachex', expected 'kvtools-kvcache')",
           root={"format": "kvtools-kvcachex"})
    broken("0004_future_major_version", "format_version = '2.0'",
           "*: format version 2.0 is not supported (this reader reads 1.x, up to 1.7)",
           root={"format_version": "2.0"})
    broken("0005_unknown_required_feature",
           "required_features = ['ragged-heads', 'x-teleported-keys']: the second is unknown",
           "*: requires feature 'x-teleported-keys', which this reader does not implement",
           hook=lambda f: f.attrs.create("required_features",
                                         ["ragged-heads", "x-teleported-keys"],
                                         dtype=h5py.string_dtype()))
    broken("0006_missing_required_attribute", "/model lacks num_kv_heads",
           "*: missing required attribute 'num_kv_heads' of '/model'",
           model={"num_kv_heads": None})
    broken("0007_incomplete", "no 'complete' mark (the writer did not finish)",
           "*: incomplete file (no 'complete' mark): its writer did not finish",
           root={"complete": None})

    def short_tokens(f):
        del f["packets/00000000/token_ids"]
        f["packets/00000000"].create_dataset("token_ids", data=np.arange(4, dtype="<i4"))
    broken("0008_shape_mismatch", "packet 'doc-1' has 4 token ids for 5 stored keys",
           "*: packet 'doc-1': 'token_ids' has 4 entries, stored_length is 5",
           hook=short_tokens)
    broken("0009_checksum",
           "one byte flipped inside the first zstd + Fletcher32 chunk of doc-2's keys",
           "*: packet 'doc-2': cannot read 'keys': data error detected by Fletcher32 checksum",
           after=lambda path: flip_byte_in_chunk(path, "packets/00000001/keys"))
    nan = packet("doc-nan", 4, 9)
    nan["values"][1, 0, 2, 3] = np.nan
    nan["values"][1, 1, 0, 0] = np.inf
    broken("0010_nan_values",
           "values of 'doc-nan' hold a NaN and an infinity: a sound file that check reports "
           "(show works)",
           "*: packet 'doc-nan': values hold 2 values that are not finite (first: NaN at layer 1, "
           "kv-head 0, token 2, dimension 3)",
           packets=[packet("doc-ok", 2, 8), nan])
    broken("0011_duplicate_ids", "two packets with the id 'twin'",
           "*: duplicate packet id 'twin' (entries 0 and 1)",
           packets=[packet("twin", 2, 1), packet("twin", 3, 2)])
    broken("0012_logical_less_than_stored", "logical_length 3 < stored_length 5",
           "*: packet 'short': logical_length 3 is less than stored_length 5",
           packets=[packet("short", 5, 1, logical=3, positions=[0, 1, 2, 2, 2])])
    broken("0013_wrong_dtype", "dtype = 'f32' but the keys are float64",
           "*: packet 'doc-1': 'keys' are not stored as f32 (the file's dtype)",
           hook=lambda f: (f["packets/00000000"].__delitem__("keys"),
                           f["packets/00000000"].create_dataset(
                               "keys", data=np.zeros((LAYERS, HEADS, 5, DIM)))))
    broken("0014_bf16_without_attribute",
           "dtype = 'bf16' but the keys lack their dtype attribute",
           "*: packet 'doc-1': 'keys' lacks the attribute dtype = 'bf16'", dtype="bf16",
           hook=lambda f: f["packets/00000000/keys"].attrs.__delitem__("dtype"))
    broken("0015_index_lengths_differ", "packet_index/stored_length has 1 entry for 2 ids",
           "*: '/packet_index/stored_length' has 1 entries, '/packet_index/id' is 2",
           hook=lambda f: (f["packet_index"].__delitem__("stored_length"),
                           f["packet_index"].create_dataset("stored_length",
                                                            data=np.array([5], dtype="<i8"))))
    broken("0016_position_out_of_range", "a position equal to logical_length",
           "*: packet 'far': position 4 is outside [0, logical_length 4)",
           packets=[packet("far", 3, 1, logical=4, positions=[0, 1, 4])])

    # Without Fletcher32, which would catch the flip before zstd sees it.
    path = os.path.join(OUT, "broken", "0017_corrupt_zstd_without_checksum.kvc")
    write_store_without_fletcher(path, [packet("big", 64, 5)])
    # zstd frames carry no checksum here (as hdf5plugin writes them): a flip inside the data
    # may decode to other values unnoticed, so break the frame's magic number instead.
    flip_byte_in_chunk(path, "packets/00000000/values", at=0)
    cases.append(("broken/0017_corrupt_zstd_without_checksum.kvc",
                  "the zstd frame header of a chunk without Fletcher32 is corrupt: "
                  "decompression must fail cleanly",
                  "*: packet 'big': cannot read 'values': filter returned failure during read"))
    broken("0018_missing_packet_group", "the index lists a packet whose group is absent",
           "*: packet 'doc-2': missing required group '/packets/00000001'",
           hook=lambda f: f["packets"].__delitem__("00000001"))
    broken("0019_keys_before_rope", "keys_after_rope = 0",
           "*: keys_after_rope is 0; only keys stored after RoPE (1) are supported",
           root={"keys_after_rope": 0})
    broken("0020_empty_id", "an empty packet id",
           "*: packet index entry 0 has an empty id", packets=[packet("", 2, 1)])

    broken("0021_index_pages_short",
           "an index whose pages hold 17 of the segment's 18 tokens",
           "*: packet 'indexed': index: pages do not hold the segment's tokens",
           packets=[packet("indexed", 18, 11)], root={"format_version": "1.1"},
           hook=lambda f: add_index(f, 0, page_sizes=[16, 1]))

    ragged_packets = [packet("ragged", 4, 13, logical=10, positions=RAGGED_SLOT_POSITIONS)]
    broken("0022_ragged_without_feature",
           "head_lengths and head_positions in a file that does not list 'ragged-heads'",
           "*: packet 'ragged': has per-head kept tokens (head_lengths) but the file does not "
           "list the feature 'ragged-heads'",
           packets=ragged_packets, root={"format_version": "1.2"},
           hook=lambda f: add_ragged(f, 0, RAGGED_LENGTHS, RAGGED_POSITIONS, declare=False))
    unordered = [[[0, 2, 5, 9], [1, 2, 6, 8]], [[0, 3, 2, 7], [0, 1, 2]]]
    broken("0023_ragged_positions_not_increasing",
           "layer 1, kv-head 0 lists positions 0, 3, 2, 7",
           "*: packet 'ragged': head positions of layer 1, kv-head 0 do not increase",
           packets=ragged_packets, root={"format_version": "1.2"},
           hook=lambda f: add_ragged(f, 0, RAGGED_LENGTHS, unordered))
    above = [[[0, 2, 5, 9], [1, 2, 6, 8]], [[0, 3, 4, 7], [0, 5, 6]]]
    broken("0024_ragged_position_above_slot",
           "layer 1, kv-head 1 keeps position 5 in slot 1, whose slot position is 3",
           "*: packet 'ragged': head position 5 of layer 1, kv-head 1 exceeds the slot's "
           "position 3",
           packets=ragged_packets, root={"format_version": "1.2"},
           hook=lambda f: add_ragged(f, 0, RAGGED_LENGTHS, above))

    broken("0025_quantized_without_feature",
           "a quantized group in a file that does not list 'quantized-kv'",
           "*: packet 'q8': is quantised but the file does not list the feature 'quantized-kv'",
           packets=[packet("q8", 3, 15)], root={"format_version": "1.3"},
           hook=lambda f: quantize_packet(f, 0, 8, 4, 0, declare=False))
    broken("0026_quantized_bad_group",
           "group_size 3 does not divide head_dim 4",
           "*: packet 'q8': quantized: quantization group size 3 does not divide head_dim 4",
           packets=[packet("q8", 3, 15)], root={"format_version": "1.3"},
           hook=lambda f: (quantize_packet(f, 0, 8, 4, 0),
                           f["packets/00000000/quantized"].attrs.__setitem__("group_size", 3)))

    broken("0027_adapter_fingerprint",
           "an adapter whose recorded fingerprint is not that of its vectors",
           "*: /adapter: the soft tokens do not match the adapter's fingerprint (the file is "
           "damaged)",
           packets=[], root={"format_version": "1.4"},
           hook=lambda f: add_adapter(f, fingerprint=sha("another adapter")))

    def wrong_shape(f):
        add_adapter(f)
        f["adapter"].attrs["header_tokens"] = 3
    broken("0028_adapter_shape",
           "header_tokens says 3, the header dataset holds 2 rows",
           # "?" stands for the brackets, which a bash glob would read as a class.
           "*: '/adapter/header' has shape ?2, 6?, expected ?3, 6?",
           packets=[], root={"format_version": "1.4"}, hook=wrong_shape)

    broken("0029_index_layers_without_feature",
           "an index over layer 1 only in a file that does not list 'index-layers'",
           "*: packet 'indexed': has an index over some layers only but the file does not "
           "list the feature 'index-layers'",
           packets=[packet("indexed", 18, 11)], root={"format_version": "1.5"},
           hook=lambda f: add_index(f, 0, layers=[1], declare=False))
    broken("0030_index_layers_decreasing", "an index whose layers are [1, 0]",
           "*: packet 'indexed': index: its layers do not increase",
           packets=[packet("indexed", 18, 11)], root={"format_version": "1.5"},
           hook=lambda f: add_index(f, 0, layers=[1, 0]))

    pair = two_packets()
    broken("0031_packet_ids_hard_link",
           "/packet_ids holds a hard link for 'doc-2' instead of a soft link",
           "*: packet 'doc-2': its link '/packet_ids/doc-2' is not a soft link",
           packets=pair, root={"format_version": "1.6"},
           hook=lambda f: (add_packet_ids(f, pair, {"doc-1": "/packets/00000000"}),
                           f["packet_ids"].__setitem__("doc-2", f["packets/00000001"])))
    broken("0032_packet_ids_wrong_group",
           "the links of 'doc-1' and 'doc-2' lead to each other's group",
           "*: packet 'doc-1': its link '/packet_ids/doc-1' leads to '/packets/00000001', not "
           "to '/packets/00000000'",
           packets=pair, root={"format_version": "1.6"},
           hook=lambda f: add_packet_ids(f, pair, {"doc-1": "/packets/00000001",
                                                   "doc-2": "/packets/00000000"}))
    broken("0033_packet_ids_missing_link", "/packet_ids has no link for 'doc-2'",
           "*: packet 'doc-2' has no link in '/packet_ids'",
           packets=pair, root={"format_version": "1.6"},
           hook=lambda f: add_packet_ids(f, pair, {"doc-1": "/packets/00000000"}))
    broken("0034_packet_ids_extra_link", "/packet_ids holds a link for no packet",
           "*: '/packet_ids' holds 3 links for 2 packets",
           packets=pair, root={"format_version": "1.6"},
           hook=lambda f: add_packet_ids(f, pair, {"doc-1": "/packets/00000000",
                                                   "doc-2": "/packets/00000001",
                                                   "doc-3": "/packets/00000001"}))
    broken("0035_checksum_chunks_1mib",
           "format_version 1.7 (chunks-1mib): one byte flipped inside doc-1's first keys chunk",
           "*: packet 'doc-1': cannot read 'keys': data error detected by Fletcher32 checksum",
           packets=one_mib, root={"format_version": "1.7", "tensor_layout": "chunks-1mib"},
           chunk_tokens=1 << 16,
           after=lambda path: flip_byte_in_chunk(path, "packets/00000000/keys"))
    broken("0036_checksum_chunks_1mib_uncompressed",
           "format_version 1.7 (chunks-1mib, Fletcher32 alone): one byte flipped inside doc-1's "
           "first values chunk",
           "*: packet 'doc-1': cannot read 'values': data error detected by Fletcher32 checksum",
           packets=one_mib, root={"format_version": "1.7", "tensor_layout": "chunks-1mib"},
           chunk_tokens=1 << 16, filters="fletcher32",
           after=lambda path: flip_byte_in_chunk(path, "packets/00000000/values"))

    # Chunks whose stored bytes do not decode to the chunk (HDF5 1.10.8 copies a whole chunk out
    # of whatever its filters returned: a short one was read past, found by fuzzing).
    broken("0037_chunk_decodes_short",
           "doc-2's positions are one shuffle + Fletcher32 chunk of 24 bytes whose stored bytes "
           "(checksum valid) hold 23",
           "*: packet 'doc-2': cannot read 'positions': a chunk that decodes to 23 bytes where "
           "the dataset's chunks hold 24",
           after=lambda path: replace_positions(
               path, 1, lambda shuffled: with_fletcher32(shuffled[:-1]), shuffle=True,
               fletcher32=True))
    broken("0038_deflate_decodes_long",
           "doc-2's positions are one deflate chunk of 24 bytes that inflates to 32",
           "*: packet 'doc-2': cannot read 'positions': a deflate chunk that decodes to more "
           "than its dataset's chunks",
           after=lambda path: replace_positions(
               path, 1, lambda shuffled: zlib.compress(shuffled + bytes(8)),
               compression="gzip"))
    broken("0039_filter_not_in_format",
           "doc-2's positions are compressed with LZF (h5py's filter 32000), which the format "
           "does not list",
           "*: packet 'doc-2': cannot read 'positions': a dataset compressed with HDF5 filter "
           "32000, which kvtools does not read (it reads shuffle, deflate, zstd and Fletcher32)",
           after=lambda path: replace_positions(
               path, 1, None, compression="lzf"))
    # A tensor's shape is read from metadata a crafted file controls: memory is set aside for it
    # only when the stored bytes could hold it (found by fuzzing: 9.6 GB asked of a 54 KB file).
    broken("0040_keys_never_written",
           "doc-2's keys have their shape, type and filters but no chunk was ever written",
           "*: packet 'doc-2': 'keys' stores no values (the dataset was never written)",
           after=lambda path: unwrite(path, 1, "keys"))
    broken("0041_positions_never_written",
           "doc-2's positions have their shape, type and filters but no chunk was ever written",
           "*: packet 'doc-2': 'positions' stores no values (the dataset was never written)",
           after=lambda path: unwrite(path, 1, "positions"))

    with open(os.path.join(OUT, "expected.tsv"), "w") as stream:
        stream.write("# file\texpected exit of 'kvinspect check'\texpected stderr (bash glob)\n")
        for relative, _, expected in cases:
            stream.write("%s\t%d\t%s\n" % (relative, 1 if expected else 0,
                                           "kvinspect: " + expected if expected else ""))
    with open(os.path.join(OUT, "README.md"), "w") as stream:
        stream.write(README_HEAD)
        for relative, description, expected in cases:
            result = ("`kvinspect check`: exit 1, `%s`" % ("kvinspect: " + expected)
                      if expected else "sound: `kvinspect check` is silent, exit 0")
            stream.write("| `%s` | %s | %s |\n" % (relative, description, result))
    print("wrote %d files under %s" % (len(cases), os.path.normpath(OUT)))


def write_store_without_fletcher(path, packets):
    with create_file(path, "v110") as f:
        for name, value in {"format": "kvtools-kvcache", "format_version": "1.0",
                            "dtype": "f32", "keys_after_rope": 1}.items():
            f.attrs[name] = value
        for group_name, values in (("model", MODEL), ("provenance", PROVENANCE)):
            group = create_group(f, group_name)
            for name, value in values.items():
                group.attrs[name] = value
        create_group(f, "packets")
        for ordinal, p in enumerate(packets):
            group = create_group(f["packets"], "%08d" % ordinal)
            for name in ("id", "text_sha256", "logical_length", "adapter_fingerprint",
                         "header_tokens", "trailer_tokens"):
                group.attrs[name] = p[name]
            group.attrs["stored_length"] = len(p["token_ids"])
            group.create_dataset("token_ids", data=p["token_ids"])
            group.create_dataset("positions", data=p["positions"])
            for name in ("keys", "values"):
                group.create_dataset(name, data=p[name], chunks=(1, 1, 64, DIM),
                                     compression=ZSTD, compression_opts=(3,))
        index = create_group(f, "packet_index")
        index.create_dataset("id", data=strings([p["id"] for p in packets]))
        index.create_dataset("text_sha256", data=strings([p["text_sha256"] for p in packets]))
        index.create_dataset("adapter_fingerprint",
                             data=strings([p["adapter_fingerprint"] for p in packets]))
        for name in ("logical_length", "header_tokens", "trailer_tokens"):
            index.create_dataset(name, data=np.array([p[name] for p in packets], dtype="<i8"))
        index.create_dataset("stored_length",
                             data=np.array([len(p["token_ids"]) for p in packets], dtype="<i8"))
        f.attrs["complete"] = 1


README_HEAD = """# Cache file conformance corpus

Files for the reader of formats/kvcache.md, written by h5py (not by kvtools) with
`tests/tools/make_kvcache_corpus.py`, which also writes this README and `expected.tsv`; rerun it
rather than editing them. Files under `good/` are sound: kvtools reads every packet and
`kvinspect check` is silent. Files under `broken/` are refused with the one-line message given
(after the file name), never a crash; `0010_nan_values` is the exception that proves the rule:
a sound file whose values are not finite, which `show` reads and `check` reports.
`tests/cli/kvinspect/corpus.sh` runs `kvinspect check` on every file against `expected.tsv`, and
`tests/unit/base/format/test_cache_file.cpp` opens every file with the library.

| file | what it holds | expected |
|---|---|---|
"""

if __name__ == "__main__":
    main()
