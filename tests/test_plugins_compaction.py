"""DFlashKVCompact on the CPU library, both layouts, against tree.compaction_indices.

The reference is out of place: gather the accepted slots from a copy of the cache
taken before compaction (what tree.compaction_indices describes), then compare the
whole cache, so a slot that should not move but did is caught too.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_plugin_support import (
    deepest_path,
    load_cpu_library,
    random_parents,
    random_path,
)

from tensorrt_llm_dflash import kernels, tree
from tensorrt_llm_dflash.errors import DFlashInputError


@pytest.fixture(scope="session")
def cpu_library() -> ctypes.CDLL:
    return load_cpu_library()


# Every correctness test runs twice: the validated CPU code and the CUDA kernels'
# own per-thread bodies (serial GPU emulation, see plugins/src/cpu/gpu_emulation.cpp).
IMPLEMENTATIONS = pytest.mark.parametrize("implementation", kernels.IMPLEMENTATIONS)


def accepted_paths(rng: np.random.Generator, batch: int, tree_nodes: int) -> list[list[int]]:
    """Row 0 accepts only the root, row 1 the full depth, the rest random paths."""
    paths = []
    for b in range(batch):
        parents = random_parents(rng, tree_nodes)
        if b == 0:
            paths.append([0])
        elif b == 1:
            paths.append(deepest_path(parents))
        else:
            paths.append(random_path(rng, parents))
    return paths


# ----------------------------------------------------------------------- linear


def linear_reference(cache: np.ndarray, past: np.ndarray, paths: list[list[int]]) -> np.ndarray:
    """[batch, 2, heads, seq, dim]: slot past+i <- slot past+accepted[i] (tree.compaction_indices)."""
    expected = cache.copy()
    for b, path in enumerate(paths):
        source = tree.compaction_indices(path, int(past[b]))
        expected[b, :, :, past[b] : past[b] + len(path)] = np.take(cache[b], source, axis=2)
    return expected


@IMPLEMENTATIONS
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
@pytest.mark.parametrize("head_dim", [1, 3, 8, 64])
def test_linear_compaction_matches_reference(
    cpu_library: ctypes.CDLL, dtype: type, head_dim: int, implementation: str
) -> None:
    rng = np.random.default_rng(head_dim)
    batch, heads, max_seq, layers, tree_nodes = 5, 3, 96, 4, 40
    caches = [
        rng.integers(-100, 100, size=(batch, 2, heads, max_seq, head_dim)).astype(dtype) for _ in range(layers)
    ]
    past = rng.integers(0, max_seq - tree_nodes, size=batch).astype(np.int32)
    paths = accepted_paths(rng, batch, tree_nodes)
    expected = [linear_reference(c, past, paths) for c in caches]
    kernels.compact_contiguous_cpu(caches, past, paths, implementation=implementation)
    for layer, (got, want) in enumerate(zip(caches, expected)):
        np.testing.assert_array_equal(got, want, err_msg=f"layer {layer}")


@IMPLEMENTATIONS
def test_linear_compaction_root_only_and_full_depth_batches(cpu_library: ctypes.CDLL, implementation: str) -> None:
    rng = np.random.default_rng(3)
    parents = random_parents(rng, 64)
    for paths in ([[0], [0], [0]], [deepest_path(parents)] * 3):
        cache = rng.standard_normal((3, 2, 2, 80, 16)).astype(np.float32)
        past = np.array([0, 5, 16], dtype=np.int32)
        expected = linear_reference(cache, past, paths)
        kernels.compact_contiguous_cpu([cache], past, paths, implementation=implementation)
        np.testing.assert_array_equal(cache, expected)


def test_linear_compaction_empty_path_moves_nothing(cpu_library: ctypes.CDLL) -> None:
    cache = np.arange(2 * 2 * 1 * 8 * 2, dtype=np.float32).reshape(2, 2, 1, 8, 2)
    before = cache.copy()
    kernels.compact_contiguous_cpu([cache], [0, 0], [[], []])
    np.testing.assert_array_equal(cache, before)


# ------------------------------------------------------------------------ paged


class PagedCache:
    """A TensorRT-LLM style paged cache with random block tables.

    Pool p holds [num_blocks, layers_in_pool, 2, heads, tokens_per_block, head_dim]
    (KVCacheManager's layout: block offset = (block * layers_in_pool + 0) * 2 + kv, see
    kvCacheManager.cpp setOffsets); layer l lives in pool pool_of[l] at index
    layer_in_pool[l] (host_kv_cache_pool_mapping).
    """

    def __init__(
        self, rng: np.random.Generator, *, batch: int, layers: int, num_pools: int, heads: int,
        head_dim: int, tokens_per_block: int, max_blocks: int, dtype: type,
    ) -> None:
        self.tokens_per_block = tokens_per_block
        self.heads, self.head_dim = heads, head_dim
        pool_of = np.arange(layers) % num_pools
        self.mapping = np.zeros((layers, 2), dtype=np.int32)
        layers_in_pool = np.zeros(num_pools, dtype=np.int64)
        for layer in range(layers):
            self.mapping[layer] = (pool_of[layer], layers_in_pool[pool_of[layer]])
            layers_in_pool[pool_of[layer]] += 1
        blocks_needed = batch * max_blocks
        self.num_blocks = blocks_needed + 3  # a few unused blocks
        self.pools = [
            rng.integers(-1000, 1000, size=(self.num_blocks, int(n), 2, heads, tokens_per_block, head_dim))
            .astype(dtype)
            for n in layers_in_pool
        ]
        # Each sequence gets its own random physical blocks in every pool.
        self.block_ids = np.stack([
            rng.permutation(self.num_blocks)[:blocks_needed].reshape(batch, max_blocks) for _ in range(num_pools)
        ])
        self.offsets = np.zeros((num_pools, batch, 2, max_blocks), dtype=np.int32)
        for pool in range(num_pools):
            for kv in range(2):
                self.offsets[pool, :, kv] = (self.block_ids[pool] * layers_in_pool[pool]) * 2 + kv

    def slot(self, layer: int, seq: int, kv: int, token: int) -> tuple[np.ndarray, tuple[int, ...]]:
        pool, layer_in_pool = self.mapping[layer]
        block = self.block_ids[pool, seq, token // self.tokens_per_block]
        return self.pools[pool], (block, layer_in_pool, kv, slice(None), token % self.tokens_per_block)

    def expected_after(self, past: np.ndarray, paths: list[list[int]]) -> list[np.ndarray]:
        expected = [p.copy() for p in self.pools]
        for layer in range(self.mapping.shape[0]):
            pool_index = int(self.mapping[layer, 0])
            for seq, path in enumerate(paths):
                source = tree.compaction_indices(path, int(past[seq]))
                for kv in range(2):
                    for i, src in enumerate(source):
                        pool, src_index = self.slot(layer, seq, kv, int(src))
                        _, dst_index = self.slot(layer, seq, kv, int(past[seq]) + i)
                        expected[pool_index][dst_index] = pool[src_index]
        return expected

    def compact(self, past: np.ndarray, paths: list[list[int]], implementation: str = "cpu") -> None:
        kernels.compact_paged_cpu(
            self.pools, self.mapping, self.offsets, self.tokens_per_block, self.heads, self.head_dim, past, paths,
            implementation=implementation,
        )


@IMPLEMENTATIONS
@pytest.mark.parametrize("tokens_per_block", [1, 2, 8, 16, 64])
@pytest.mark.parametrize("num_pools", [1, 2])
def test_paged_compaction_matches_reference(
    cpu_library: ctypes.CDLL, tokens_per_block: int, num_pools: int, implementation: str
) -> None:
    rng = np.random.default_rng(tokens_per_block * 10 + num_pools)
    batch, tree_nodes = 4, 30
    max_blocks = (200 + tokens_per_block - 1) // tokens_per_block
    cache = PagedCache(
        rng, batch=batch, layers=3, num_pools=num_pools, heads=2, head_dim=8,
        tokens_per_block=tokens_per_block, max_blocks=max_blocks, dtype=np.float16,
    )
    past = rng.integers(0, max_blocks * tokens_per_block - tree_nodes, size=batch).astype(np.int32)
    paths = accepted_paths(rng, batch, tree_nodes)
    expected = cache.expected_after(past, paths)
    cache.compact(past, paths, implementation)
    for got, want in zip(cache.pools, expected):
        np.testing.assert_array_equal(got, want)


@IMPLEMENTATIONS
def test_paged_compaction_random_geometries(cpu_library: ctypes.CDLL, implementation: str) -> None:
    rng = np.random.default_rng(11)
    for _ in range(8):
        tokens_per_block = int(2 ** rng.integers(0, 7))
        batch = int(rng.integers(1, 5))
        tree_nodes = int(rng.integers(1, 50))
        max_blocks = int(rng.integers(1, 6)) + (tree_nodes + 60) // tokens_per_block
        cache = PagedCache(
            rng, batch=batch, layers=int(rng.integers(1, 4)), num_pools=int(rng.integers(1, 3)),
            heads=int(rng.integers(1, 4)), head_dim=int(rng.integers(1, 20)),
            tokens_per_block=tokens_per_block, max_blocks=max_blocks, dtype=np.float32,
        )
        past = rng.integers(0, max_blocks * tokens_per_block - tree_nodes + 1, size=batch).astype(np.int32)
        paths = accepted_paths(rng, batch, tree_nodes)
        expected = cache.expected_after(past, paths)
        cache.compact(past, paths, implementation)
        for got, want in zip(cache.pools, expected):
            np.testing.assert_array_equal(got, want)


@IMPLEMENTATIONS
def test_paged_compaction_many_layers_span_several_launches(cpu_library: ctypes.CDLL, implementation: str) -> None:
    """70 layers = three launches of at most 32 layers (kLayersPerLaunch)."""
    rng = np.random.default_rng(70)
    cache = PagedCache(
        rng, batch=2, layers=70, num_pools=2, heads=1, head_dim=4, tokens_per_block=4, max_blocks=12,
        dtype=np.float32,
    )
    past = np.array([3, 9], dtype=np.int32)
    paths = accepted_paths(rng, 2, 30)
    expected = cache.expected_after(past, paths)
    cache.compact(past, paths, implementation)
    for got, want in zip(cache.pools, expected):
        np.testing.assert_array_equal(got, want)


@IMPLEMENTATIONS
def test_linear_compaction_many_layers_span_several_launches(cpu_library: ctypes.CDLL, implementation: str) -> None:
    rng = np.random.default_rng(71)
    caches = [rng.standard_normal((2, 2, 1, 48, 4)).astype(np.float32) for _ in range(65)]
    past = np.array([0, 7], dtype=np.int32)
    paths = accepted_paths(rng, 2, 30)
    expected = [linear_reference(c, past, paths) for c in caches]
    kernels.compact_contiguous_cpu(caches, past, paths, implementation=implementation)
    for got, want in zip(caches, expected):
        np.testing.assert_array_equal(got, want)


def test_gpu_kernel_skips_bad_sequences_and_compacts_the_rest(cpu_library: ctypes.CDLL) -> None:
    """On the GPU nothing can be reported: a bad path is skipped, never half-moved."""
    rng = np.random.default_rng(17)
    cache = rng.standard_normal((4, 2, 2, 32, 8)).astype(np.float32)
    past = np.array([2, 2, 30, 4], dtype=np.int32)
    paths = [[0, 3, 1], [0, 2, 5], [0, 4], [1, 2]]  # decreasing, good, beyond capacity, wrong root
    expected = cache.copy()
    expected[1] = linear_reference(cache[1:2], past[1:2], paths[1:2])[0]
    kernels.compact_contiguous_cpu([cache], past, paths, implementation="gpu-emulation")
    np.testing.assert_array_equal(cache, expected)


@IMPLEMENTATIONS
def test_paged_compaction_reads_secondary_pool_blocks(cpu_library: ctypes.CDLL, implementation: str) -> None:
    """A KVCacheIndex with pool type 1 (secondary) addresses the secondary pool."""
    heads, head_dim, tpb = 1, 4, 4
    primary = np.zeros((4, 1, 2, heads, tpb, head_dim), dtype=np.float32)
    secondary = np.arange(4 * 2 * tpb * head_dim, dtype=np.float32).reshape(4, 1, 2, heads, tpb, head_dim)
    offsets = np.zeros((1, 1, 2, 2), dtype=np.int32)
    secondary_flag = 1 << 30  # KVCacheIndex::kSecondaryPoolFlag (PoolType::kSecondary << 30)
    for kv in range(2):
        offsets[0, 0, kv] = [(0 * 2 + kv), (3 * 2 + kv) | secondary_flag]  # block 1 lives in secondary block 3
    kernels.compact_paged_cpu(
        [primary], [[0, 0]], offsets, tpb, heads, head_dim, [0], [[0, 1, 5]], secondary_pools=[secondary],
        implementation=implementation,
    )
    # slot 1 <- slot 1 (in primary block 0, unchanged: zeros); slot 2 <- slot 5 (secondary block 3, row 1)
    for kv in range(2):
        np.testing.assert_array_equal(primary[0, 0, kv, 0, 2], secondary[3, 0, kv, 0, 1])
        np.testing.assert_array_equal(primary[0, 0, kv, 0, 1], np.zeros(head_dim))


# ------------------------------------------------------------------------ errors


def _linear(batch: int = 2, max_seq: int = 16) -> list[np.ndarray]:
    return [np.zeros((batch, 2, 1, max_seq, 4), dtype=np.float32)]


@pytest.mark.parametrize(
    ("past", "paths", "fragment"),
    [
        ([0, 0], [[0], [1, 2]], r"accepted_nodes\[1\]\[0\]=1: the first accepted node must be the root 0"),
        ([0, 0], [[0, 3, 3], [0]], r"accepted_nodes\[0\]\[2\]=3: accepted nodes must be strictly increasing"),
        ([0, 0], [[0, 4, 2], [0]], r"accepted_nodes\[0\]\[2\]=2: accepted nodes must be strictly increasing"),
        ([10, 0], [[0, 6], [0]], r"accepted_nodes\[0\]\[1\]: its KV slot past_len \+ node = 16 is beyond the cache capacity 16"),
        ([0, -3], [[0], [0]], r"past_lengths\[1\]=-3 must not be negative"),
    ],
)
def test_linear_compaction_bad_input_raises(
    cpu_library: ctypes.CDLL, past: list[int], paths: list[list[int]], fragment: str
) -> None:
    caches = _linear()
    with pytest.raises(DFlashInputError, match=fragment):
        kernels.compact_contiguous_cpu(caches, past, paths)
    assert not caches[0].any(), "a refused call must leave the cache untouched"


def test_paged_compaction_bad_tokens_per_block(cpu_library: ctypes.CDLL) -> None:
    pool = np.zeros((4, 1, 2, 1, 3, 4), dtype=np.float32)
    offsets = np.zeros((1, 1, 2, 2), dtype=np.int32)
    with pytest.raises(DFlashInputError, match="tokens_per_block=3 must be a positive power of two"):
        kernels.compact_paged_cpu([pool], [[0, 0]], offsets, 3, 1, 4, [0], [[0, 1]])


def test_paged_compaction_bad_pool_mapping(cpu_library: ctypes.CDLL) -> None:
    pool = np.zeros((4, 1, 2, 1, 4, 4), dtype=np.float32)
    offsets = np.zeros((1, 1, 2, 2), dtype=np.int32)
    with pytest.raises(DFlashInputError, match=r"pool_mapping\[1\] refers to pool/layer 5"):
        kernels.compact_paged_cpu([pool], [[0, 0], [5, 0]], offsets, 4, 1, 4, [0], [[0, 1]])


def test_paged_compaction_block_outside_pool(cpu_library: ctypes.CDLL) -> None:
    pool = np.zeros((2, 1, 2, 1, 4, 4), dtype=np.float32)  # 4 layer-blocks in the pool
    offsets = np.zeros((1, 1, 2, 2), dtype=np.int32)
    offsets[0, 0, :, 1] = [8, 9]  # block 1 of the sequence points past the pool
    with pytest.raises(DFlashInputError, match="block_offsets for sequence 0, block 1 = 8 points outside its pool"):
        kernels.compact_paged_cpu([pool], [[0, 0]], offsets, 4, 1, 4, [2], [[0, 3]])
    assert not pool.any()


def test_paged_compaction_secondary_block_without_secondary_pool(cpu_library: ctypes.CDLL) -> None:
    pool = np.zeros((2, 1, 2, 1, 4, 4), dtype=np.float32)
    offsets = np.zeros((1, 1, 2, 1), dtype=np.int32)
    offsets[0, 0, 0, 0] = 1 << 30
    with pytest.raises(DFlashInputError, match="points outside its pool"):
        kernels.compact_paged_cpu([pool], [[0, 0]], offsets, 4, 1, 4, [0], [[0, 1]])


def test_paged_compaction_slot_beyond_block_table(cpu_library: ctypes.CDLL) -> None:
    pool = np.zeros((4, 1, 2, 1, 4, 4), dtype=np.float32)
    offsets = np.zeros((1, 1, 2, 2), dtype=np.int32)
    with pytest.raises(DFlashInputError, match="beyond the cache capacity 8"):
        kernels.compact_paged_cpu([pool], [[0, 0]], offsets, 4, 1, 4, [5], [[0, 3]])


def test_compaction_shape_errors(cpu_library: ctypes.CDLL) -> None:
    with pytest.raises(DFlashInputError, match="accepted_nodes has 1 rows for a batch of 2"):
        kernels.compact_contiguous_cpu(_linear(), [0, 0], [[0]])
    with pytest.raises(DFlashInputError, match="past_lengths has 3 entries for a batch of 2"):
        kernels.compact_contiguous_cpu(_linear(), [0, 0, 0], [[0], [0]])
    with pytest.raises(DFlashInputError, match=r"layer_caches\[0\] must be \[batch, 2, kv_heads"):
        kernels.compact_contiguous_cpu([np.zeros((2, 3, 1, 4, 4))], [0, 0], [[0], [0]])
