"""The packed-weights cache (models/packed_cache.py): a load that reads it packs nothing and gives
the same model bit for bit (packed tensors, logits, greedy tokens) as the load that packed and
wrote it; a broken or foreign file is packed again; one file per checkpoint and format."""
from __future__ import annotations

import collections
import gc
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from specguide import kernels
from specguide.engine.kv_cache import KVCache
from specguide.models import packed_cache
from specguide.models.linear import InvariantLinear
from specguide.models.loader import load_model

from .test_architectures import _make

pytestmark = pytest.mark.skipif(kernels.library() is None, reason=f"no C compiler: {kernels.unavailable_reason()}")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, empty cache directory; returns its packed/ folder."""
    monkeypatch.setenv("SPECGUIDE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "packed"


@pytest.fixture
def packs(monkeypatch) -> collections.Counter:
    """Calls of the packing functions (linear.py calls them as kernels.<name>)."""
    calls: collections.Counter = collections.Counter()
    for name in ("pack_weight", "pack_exact"):
        def counted(*args, _fn=getattr(kernels, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small Qwen2 (q|k|v bias, tied head) whose layers hold what "auto" turns into every format:
    layer 0's linears exact Q4_1 blocks, layer 1's attention exact Q8_0, its MLP bf16 values; the
    head float32."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("qwen2")
    _make("qwen2", path)
    state = {k: v.clone() for k, v in load_file(path / "model.safetensors").items()}
    for k, v in state.items():
        if k.endswith("_proj.weight"):
            fmt = "q4_1" if ".layers.0." in k else "q8_0" if "self_attn" in k else "bfloat16"
            state[k] = kernels.dequantized(v, fmt)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def packed(model) -> dict[str, tuple]:
    return {name: (m.weight_dtype, m.packed, m.scale, m.bias) for name, m in model.named_modules()
            if isinstance(m, InvariantLinear)}


def assert_same_packing(a, b) -> None:
    pa, pb = packed(a), packed(b)
    assert pa.keys() == pb.keys() and len(pa) == 1 + 4 * a.cfg.num_layers
    for name in pa:
        (fa, *ta), (fb, *tb) = pa[name], pb[name]
        assert fa == fb, name
        for x, y in zip(ta, tb):
            assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), name


@torch.inference_mode()
def greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after `prompt` (one prefill, then one token a step) and every step's logits."""
    kv = KVCache(model.cfg.num_layers, 1, model.cfg.num_kv_heads, len(prompt) + n, model.cfg.head_dim, torch.float32)
    ids, out, logits = list(prompt), [], []
    start = 0
    for _ in range(n):
        ctx = model.make_context(torch.tensor([0]), torch.arange(start, len(ids))[None], [0], len(ids))
        step = model.logits(model(torch.tensor([ids[start:]]), ctx, kv))[0, -1]
        logits.append(step)
        start = len(ids)
        ids.append(int(step.argmax()))
        out.append(ids[-1])
    return out, torch.stack(logits)


def cold_then_warm(folder, packs, weight_dtype: str, integer_dot: bool, cache):
    cold = load_model(folder, torch.float32, "cpu", weight_dtype, integer_dot, cache=True)
    assert sum(packs.values()) > 0
    assert len(list(cache.glob("*.pt"))) == 1
    packs.clear()
    warm = load_model(folder, torch.float32, "cpu", weight_dtype, integer_dot, cache=True)
    assert sum(packs.values()) == 0, packs  # every linear came from the file
    assert_same_packing(cold, warm)
    assert warm.fused is not None and len(warm.fused) == warm.cfg.num_layers
    return cold, warm


@pytest.mark.parametrize("weight_dtype, integer_dot", [("auto", True), ("auto", False), ("float32", False),
                                                       ("bfloat16", False), ("int8", False), ("q4_1", False),
                                                       ("q8_0", True)])
def test_a_cached_load_packs_nothing_and_is_bit_identical(checkpoint, cache, packs, weight_dtype, integer_dot):
    cold, warm = cold_then_warm(checkpoint, packs, weight_dtype, integer_dot, cache)
    formats = {m.weight_dtype for m in warm.modules() if isinstance(m, InvariantLinear)}
    if weight_dtype == "auto":  # the checkpoint holds every format auto picks
        assert formats == ({"q4_1_q8", "q8_0_q8"} if integer_dot else {"q4_1", "q8_0"}) | {"bfloat16", "float32"}
    prompt = list(range(3, 40, 3))
    tokens, logits = greedy(cold, prompt, 8)
    warm_tokens, warm_logits = greedy(warm, prompt, 8)
    assert warm_tokens == tokens and torch.equal(warm_logits, logits)


@pytest.mark.parametrize("kind", ["llama3", "phi3"])
def test_untied_head_and_fused_checkpoint_projections(kind, tmp_path, cache, packs):
    """An untied LM head (Llama 3) and q|k|v, gate|up fused in the checkpoint (Phi-3)."""
    _make(kind, tmp_path / "hf")
    cold, warm = cold_then_warm(tmp_path / "hf", packs, "int8", False, cache)
    every = torch.arange(cold.cfg.vocab_size)
    assert torch.equal(warm.head_rows(every), cold.head_rows(every))  # the draft heads' rows of the LM head
    (tokens, logits), (warm_tokens, warm_logits) = greedy(cold, [1, 5, 9], 6), greedy(warm, [1, 5, 9], 6)
    assert warm_tokens == tokens and torch.equal(warm_logits, logits)


def test_the_default_model_loads_bit_identical_from_the_cache(model_dir, cache, packs):
    cold, warm = cold_then_warm(model_dir, packs, "float32", False, cache)
    tokens, logits = greedy(cold, [1, 504, 3575, 282, 4649, 314], 12)
    warm_tokens, warm_logits = greedy(warm, [1, 504, 3575, 282, 4649, 314], 12)
    assert warm_tokens == tokens and torch.equal(warm_logits, logits)


def test_a_truncated_or_foreign_file_is_packed_again(checkpoint, cache, packs, caplog):
    cold = load_model(checkpoint, torch.float32, "cpu", "auto", True, cache=True)
    (path,) = cache.glob("*.pt")
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # as a full disk or a killed copy would leave it
    packs.clear()
    with caplog.at_level(logging.WARNING, logger="specguide"):
        again = load_model(checkpoint, torch.float32, "cpu", "auto", True, cache=True)
    assert packs["pack_exact"] > 0 and "unreadable" in caplog.text
    assert_same_packing(cold, again)
    assert path.read_bytes() == good  # written again, whole
    # the right name, readable, but a tensor of another shape: never handed to the kernels
    blob = torch.load(path, weights_only=True)
    entry = blob["linears"]["layers.0.qkv"]
    entry["packed"] = entry["packed"][:, :-4].contiguous()
    torch.save(blob, path)
    packs.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specguide"):
        again = load_model(checkpoint, torch.float32, "cpu", "auto", True, cache=True)
    assert packs["pack_exact"] > 0 and "layers.0.qkv: packed" in caplog.text
    assert_same_packing(cold, again)


def test_at_most_two_keys_per_checkpoint_and_format(checkpoint, tmp_path, cache, packs):
    """A changed checkpoint (a new key) keeps the previous key's file, not the one before (the
    two most recently used stay: two checkouts with different packing code share a cache); names no
    load makes go; a checkpoint folder that is gone loses its entries at the next write, and so does
    a crashed writer's temporary file."""
    folder = tmp_path / "copy"
    shutil.copytree(checkpoint, folder)
    weights = folder / "model.safetensors"

    def int8_entries() -> list[str]:
        return sorted(p.name for p in cache.glob("*-int8.*.pt"))

    def touch(path, seconds: int) -> None:
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + seconds * 10**9))

    load_model(folder, torch.float32, "cpu", "int8", cache=True)
    load_model(folder, torch.float32, "cpu", "float32", cache=True)
    (first,) = int8_entries()
    assert len(list(cache.glob("*.pt"))) == 2 and len(list(cache.glob("*.source"))) == 1
    packs.clear()
    load_model(folder, torch.float32, "cpu", "int8", True, cache=True)  # int8 activations: the same int8 bytes
    assert not packs and len(list(cache.glob("*.pt"))) == 2
    (stem,) = (p.stem for p in cache.glob("*.source"))
    orphans = [cache / f"{stem}-int4.0123456789abcdef.pt", cache / f"{stem}-int8-int8act.0123456789abcdef.pt"]
    for p in orphans:  # names no load makes (no such format; int8 activations do not change int8)
        p.write_bytes(b"old")
    touch(weights, 1)
    packs.clear()
    load_model(folder, torch.float32, "cpu", "int8", cache=True)
    assert packs["pack_weight"] > 0  # another key: packed again
    (second,) = set(int8_entries()) - {first}
    assert int8_entries() == sorted([first, second]) and not any(p.exists() for p in orphans)
    touch(cache / first, -100)  # the older one (mtimes are the use order: a read touches its file)
    touch(weights, 1)
    load_model(folder, torch.float32, "cpu", "int8", cache=True)
    assert first not in int8_entries() and second in int8_entries() and len(int8_entries()) == 2
    assert len(list(cache.glob("*-float32.*.pt"))) == 1  # another format: its own keys
    crashed = cache / "x.pt.1234.tmp"
    crashed.write_bytes(b"half")
    os.utime(crashed, (0, 0))
    shutil.rmtree(folder)
    load_model(checkpoint, torch.float32, "cpu", "int8", cache=True)
    entry = packed_cache.PackedCache(checkpoint, [checkpoint / "model.safetensors"], "int8", False)
    assert [p.name for p in cache.glob("*.pt")] == [entry.path.name]
    assert [p.name for p in cache.glob("*.source")] == [f"{entry.stem}.source"] and not crashed.exists()


def test_the_checkpoint_file_is_not_left_mapped(checkpoint, cache):
    """Cold or warm, the model holds copies of what it keeps of the checkpoint: safetensors' mapping
    of the file ends with the load (it kept every page the packing read resident: the engine's
    memory was ~500 MiB larger after packing the default model in float32 than after a cached load)."""
    for _ in range(2):
        model = load_model(checkpoint, torch.float32, "cpu", "int8", cache=True)
        gc.collect()
        assert str(checkpoint / "model.safetensors") not in Path("/proc/self/maps").read_text()
        assert model.embed.weight.untyped_storage().nbytes() == model.embed.weight.nbytes


def test_no_cache_asked_nothing_written(checkpoint, cache, packs):
    load_model(checkpoint, torch.float32, "cpu", "auto", True)
    packs.clear()
    load_model(checkpoint, torch.float32, "cpu", "auto", True, cache=False)
    assert packs["pack_exact"] > 0 and not cache.exists()


@pytest.mark.parametrize("fmt", kernels.FORMATS)
def test_the_layout_table_is_what_packing_gives(fmt):
    """packed_cache.layout (what a cached entry is checked against) for O not a multiple of 64."""
    w = kernels.dequantized(torch.randn(100, 96, generator=torch.Generator().manual_seed(0)), fmt)
    packed, aux = kernels.pack_weight(w, fmt)
    want_packed, want_aux = packed_cache.layout(fmt, 100, 96)
    assert (tuple(packed.shape), packed.dtype) == want_packed
    assert (None if aux is None else (tuple(aux.shape), aux.dtype)) == want_aux
