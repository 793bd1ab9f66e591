"""Load targets and drafters: hub id, local directory, GGUF from registry packages, tiny.

GGUF models are fetched without dependencies, reassembled from their parts, sha256-checked and
de-quantised by transformers' gguf support once; the result is cached as safetensors in the
requested dtype so later loads take seconds. Nothing here reads a Hydra config: callers pass plain
mappings.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnidraft.data.artifacts import Member, assemble, cache_lock, sha256_file, temp_dir_beside
from omnidraft.errors import OmniDraftError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}

# Vocabulary-only GGUFs shipped in the llama-cpp-python sdist: real tokenizers of the paper's
# models, used with tiny random-weight models in tests and debug runs.
_LCPP = ("llama-cpp-python", "0.3.36", "llama_cpp_python-0.3.36/vendor/llama.cpp/models/")
_LCPP_SHA = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # the sdist, checked before it is read
VOCAB_FILES = {
    "llama-spm": ("ggml-vocab-llama-spm.gguf",
                  "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69"),
    "llama-bpe": ("ggml-vocab-llama-bpe.gguf",
                  "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e"),
    "qwen2": ("ggml-vocab-qwen2.gguf",
              "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c"),
}


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and where it came from."""

    name: str
    model: Any
    tokenizer: Any
    dtype: torch.dtype
    device: torch.device
    max_context: int
    load_s: float
    source: str

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end generation: the tokenizer's EOS and the generation config's."""
        ids: set[int] = set()
        for v in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v)
        return ids


def native_bf16(device: str | torch.device = "cpu", flags: set[str] | None = None) -> bool:
    """Whether bf16 matmuls run natively on ``device``: CUDA with bf16 support, or a CPU with
    AVX512-BF16 / AMX-BF16 (x86) or the ``bf16`` feature (aarch64). Elsewhere torch emulates bf16
    on the CPU: a 150-token prefill of Qwen2.5-Coder-1.5B took 18 s in bf16 and 5 s in fp32 on
    one AVX512 core without AVX512-BF16 (LOG.md, 2026-12-02).

    Args:
        flags: the CPU feature flags (default: read from /proc/cpuinfo).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    from omnidraft.provenance import BF16_FLAGS, cpu_flags

    return bool((cpu_flags() if flags is None else flags) & set(BF16_FLAGS))


def resolve_device(name: str, key: str = "device") -> str:
    """A model config's device with ``auto`` resolved (``cuda`` when torch sees a CUDA device, else
    ``cpu``), checked: a CUDA device this machine lacks, or a name torch does not know, is refused.

    Args:
        name: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (``mps`` where torch has it).
        key: the config key, for the message (``target.device``).

    Raises:
        OmniDraftError: one line naming the value and the fix.
    """
    name = str(name)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise OmniDraftError(f"{key}={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise OmniDraftError(f"{key}={name}: this torch ({torch.__version__}) sees no CUDA device; set {key}=cpu "
                                 "(or auto), or install a CUDA build of torch (README: GPU)")
        if dev.index is not None and dev.index >= n:
            raise OmniDraftError(f"{key}={name}: this machine has {n} CUDA device(s); use cuda:0..cuda:{n - 1}")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise OmniDraftError(f"{key}={name}: MPS is not available here; set {key}=cpu (or auto)")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise OmniDraftError(f"{key}={name!r}: this framework runs on cpu, cuda or mps; use auto, cpu, cuda or cuda:N")
    return name


def resolve_dtype(name: str, device: str | torch.device = "cpu", flags: set[str] | None = None) -> str:
    """A model config's dtype name with ``auto`` resolved: bfloat16 where it is native on
    ``device`` (:func:`native_bf16`), float32 elsewhere. Other names pass through unchanged."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(device, flags) else "float32"


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    name = resolve_dtype(name, device)
    if name not in DTYPES:
        raise OmniDraftError(f"unknown dtype {name!r}; use auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(spec: Mapping[str, Any], cache_dir: Path) -> LoadedModel:
    """Load the model described by one target/drafter config node.

    Args:
        spec: a ModelConfig as a plain mapping (name, source, hub_id, path, gguf, tiny, dtype...).
        cache_dir: root of the download / conversion cache.
    """
    t0 = time.perf_counter()
    cache_dir = Path(cache_dir).expanduser()  # a portable config.yaml keeps '~' (never a literal './~' directory)
    device = torch.device(resolve_device(spec.get("device", "cpu"), f"{spec.get('name', 'model')}.device"))
    dtype = parse_dtype(spec.get("dtype", "auto"), device)
    source = spec["source"]
    if spec.get("trust_remote_code"):
        raise OmniDraftError(
            f"model {spec['name']!r} sets trust_remote_code=true; this framework only runs "
            "architectures that transformers ships, set it back to false")
    if source == "gguf_package":
        path = _ensure_converted(spec, Path(cache_dir), dtype)
        model, tok = _from_pretrained(path, dtype)
    elif source == "local":
        if not spec.get("path") or not Path(spec["path"]).is_dir():
            raise OmniDraftError(
                f"model {spec['name']!r}: local path {spec.get('path')!r} is not a directory; "
                "set <role>.path=/dir/with/config.json")
        model, tok = _from_pretrained(spec["path"], dtype)
    elif source == "hub":
        model, tok = _from_hub(spec, dtype)
    elif source == "tiny":
        model, tok = build_tiny(spec["tiny"], Path(cache_dir), dtype)
    elif source == "given":
        raise OmniDraftError(f"model {spec['name']!r} has source=given: pass the model object to "
                             "omnidraft.api.from_models, or pick a model config (target=..., drafter=...)")
    else:
        raise OmniDraftError(f"model {spec['name']!r}: unknown source {source!r}; "
                             "use gguf_package, hub, local or tiny")
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    max_ctx = spec.get("max_context") or getattr(model.config, "max_position_embeddings", 2048)
    return LoadedModel(spec["name"], model, tok, dtype, device, int(max_ctx),
                       time.perf_counter() - t0, source)


def wrap_model(model, tokenizer, name: str | None = None, max_context: int | None = None) -> LoadedModel:
    """An HF causal LM and its tokenizer, built by the caller, as a :class:`LoadedModel`: put in
    eval mode with gradients off (the online learner trains its own copy, or the weights in place
    for a full fine-tune), nothing copied.

    Args:
        model: a transformers ``PreTrainedModel`` with a causal-LM head.
        tokenizer: its tokenizer.
        name: what runs call it (default: ``model.name_or_path``).
        max_context: positions it may use (default: ``config.max_position_embeddings``).
    """
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise OmniDraftError(f"{type(model).__name__} has no LM head: pass an AutoModelForCausalLM")
    if not callable(getattr(tokenizer, "encode", None)):
        raise OmniDraftError(f"{type(tokenizer).__name__} is not a tokenizer: pass the model's AutoTokenizer")
    p = next(model.parameters())
    model.eval()
    for q in model.parameters():
        q.requires_grad_(False)
    name = name or str(getattr(model, "name_or_path", "") or type(model).__name__)
    max_ctx = max_context or getattr(model.config, "max_position_embeddings", 2048)
    return LoadedModel(name, model, tokenizer, p.dtype, p.device, int(max_ctx), 0.0, "given")


def _from_pretrained(path, dtype, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False, **kw)
    return model, tok


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_hub(spec: Mapping[str, Any], dtype: torch.dtype):
    hub_id, rev = spec["hub_id"], spec.get("revision")
    try:  # a copy already in the local HF cache works offline
        return _from_pretrained(hub_id, dtype, revision=rev, local_files_only=True)
    except OSError:
        pass
    if not _hub_reachable():
        raise OmniDraftError(
            f"model {spec['name']!r} needs hub id {hub_id!r}, but no model hub is reachable and it "
            f"is not in the local HF cache; download it elsewhere and pass "
            f"<role>.source=local <role>.path=/path/to/{hub_id.split('/')[-1]}")
    return _from_pretrained(hub_id, dtype, revision=rev)


def gguf_members(g: Mapping[str, Any]) -> list[Member]:
    n = int(g.get("n_parts", 1))
    # {i}: 1-based part number, {j}: 0-based
    pins = list(g.get("artifact_sha256") or [])
    if pins and len(pins) != n:
        raise OmniDraftError(f"gguf.artifact_sha256 has {len(pins)} checksums for {n} parts; give one per part")
    return [Member(g["package"].format(i=i, j=i - 1), g["version"], g["member"].format(i=i, j=i - 1),
                   g.get("dist", "wheel"), pins[i - 1] if pins else None) for i in range(1, n + 1)]


def _ensure_converted(spec: Mapping[str, Any], cache_dir: Path, dtype: torch.dtype) -> Path:
    """Return a directory with safetensors weights + tokenizer converted from the GGUF, each file's
    size and sha256 recorded at conversion and checked again before it is used (a damaged or
    half-copied cache entry is converted anew, not trusted by its marker)."""
    g = spec["gguf"]
    dname = str(dtype).removeprefix("torch.")
    out = cache_dir / "converted" / f"{spec['name']}-{g['sha256'][:12]}-{dname}"
    marker = out / "omnidraft_source.json"
    if _verified(out, marker):
        return out
    with cache_lock(out):
        if _verified(out, marker):  # another process converted it while this one waited
            return out
        gguf_path = assemble(gguf_members(g), cache_dir / "gguf" / g["filename"], g["sha256"],
                             cache_dir, remove_downloads=True)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype)
        # save_pretrained refuses a model that still carries its GGUF quantiser; the weights are
        # already de-quantised, so drop the marker and save plain safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = temp_dir_beside(out)
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            _write_marker(tmp, {"gguf": g["filename"], "sha256": g["sha256"], "dtype": dname})
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


_MARKER = "omnidraft_source.json"


def _write_marker(d: Path, info: dict[str, Any]) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(Path(d).iterdir()) if p.is_file() and p.name != _MARKER}
    (Path(d) / _MARKER).write_text(json.dumps({**info, "files": files}, indent=1))


@functools.lru_cache(maxsize=None)
def _verified_once(d: str, stamp: tuple) -> bool:
    marker = json.loads((Path(d) / _MARKER).read_text())
    files = marker.get("files")
    if not files:
        return False  # written before files were recorded: not trusted
    for name, want in files.items():
        p = Path(d) / name
        if not p.is_file() or p.stat().st_size != want["size"] or sha256_file(p) != want["sha256"]:
            return False
    return True


def _stamp(d: Path) -> tuple:
    """The version of cache entry ``d``'s files: each one's name, modification time and size."""
    return tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in d.iterdir() if p.is_file()))


def _verified(d: Path, marker: Path) -> bool:
    """Whether cache entry ``d`` holds every file its marker records, each of the recorded size and
    sha256 (hashed once per process and modification time)."""
    try:
        return marker.is_file() and _verified_once(str(d), _stamp(d))
    except (OSError, ValueError):
        return False


def load_vocab_tokenizer(key: str, cache_dir: Path):
    """A real tokenizer from a vocabulary-only GGUF (llama-cpp-python sdist), cached on disk."""
    from transformers import AutoTokenizer

    if key not in VOCAB_FILES:
        raise OmniDraftError(f"unknown tokenizer {key!r}; use one of {', '.join(VOCAB_FILES)}")
    fname, sha = VOCAB_FILES[key]
    saved = Path(cache_dir) / "tokenizers" / f"{key}-{sha[:12]}"
    if _verified(saved, saved / _MARKER):
        return _loaded_tokenizer(saved)
    with cache_lock(saved):
        if not _verified(saved, saved / _MARKER):
            pkg, ver, prefix = _LCPP
            gguf = assemble([Member(pkg, ver, prefix + fname, "sdist", _LCPP_SHA)],
                            Path(cache_dir) / "vocab" / fname, sha, cache_dir)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            tmp = temp_dir_beside(saved)
            try:
                tok.save_pretrained(tmp)
                _write_marker(tmp, {"gguf": fname, "sha256": sha})
                shutil.rmtree(saved, ignore_errors=True)
                os.replace(tmp, saved)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return _loaded_tokenizer(saved)


def _loaded_tokenizer(saved: Path):
    """The tokenizer saved in ``saved``, loaded once per process and per version of its files (a
    150k vocabulary takes seconds to load, and every tiny model and test asks again). The instance
    is shared: callers that change it (``add_tokens``) work on a ``copy.deepcopy``."""
    return _tokenizer_once(str(saved), _stamp(saved))


@functools.lru_cache(maxsize=None)
def _tokenizer_once(saved: str, stamp: tuple):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(saved)


def build_tiny(t: Mapping[str, Any], cache_dir: Path, dtype: torch.dtype):
    """A tiny model of a real architecture with deterministic weights and a real tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tok = load_vocab_tokenizer(t["tokenizer"], cache_dir)
    arch = {"llama": LlamaConfig, "qwen2": Qwen2Config}.get(t["arch"])
    if arch is None:
        raise OmniDraftError(f"unknown tiny arch {t['arch']!r}; use llama or qwen2")
    cfg = arch(vocab_size=len(tok), hidden_size=t["hidden_size"], num_hidden_layers=t["num_layers"],
               num_attention_heads=t["num_heads"], num_key_value_heads=t["num_kv_heads"],
               intermediate_size=t["intermediate_size"],
               max_position_embeddings=t["max_position_embeddings"],
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    fixed_init(model, t["init_seed"], t["init_std"])
    return model.to(dtype), tok


@torch.no_grad()
def fixed_init(model: torch.nn.Module, seed: int, std: float) -> None:
    """Deterministic init from an explicit generator (no global seeding)."""
    g = torch.Generator().manual_seed(int(seed))
    for name, p in sorted(model.named_parameters()):
        if p.ndim >= 2:
            fan_in = p.shape[1]
            p.copy_(torch.randn(p.shape, generator=g) * (std if "embed" in name else 1.0 / fan_in ** 0.5))
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        else:
            p.fill_(1.0)


def sliding_window(config) -> int | None:
    """The attention window of models with sliding-window layers (e.g. Gemma-3), else None."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return int(config.sliding_window)
    return None
