"""`ecomla export gguf`: a checkpoint as a GGUF file for llama.cpp, written by llama.cpp's own converter.

    ecomla export gguf CHECKPOINT OUT.gguf [--outtype f32|f16|bf16|q8_0] [--converter DIR]

CHECKPOINT is an ecomla MLA checkpoint (stock DeepSeek-V3, which llama.cpp runs as its DEEPSEEK2
architecture, caching only the latent and the shared RoPE key) or the source Llama it came from, so that the
two can be compared in the engine.

The converter is not rewritten here. `convert_hf_to_gguf.py` and its `conversion/` and `gguf-py/` packages
ship in the llama-cpp-python *source* distribution (vendor/llama.cpp), not in its wheel. The first export
downloads that sdist from the package index with pip (the version of the installed llama-cpp-python, else
`LLAMA_CPP_VERSION`) and unpacks those three entries into a cache directory (`converter_dir()`); later exports
reuse it. `--converter DIR` points at any llama.cpp checkout instead.

What the converter's input needs and an ecomla checkpoint does not say the way llama.cpp reads it, fixed in a
temporary copy of config.json (the weights are linked, not copied; the checkpoint itself stays as transformers
wants it):
- `q_lora_rank: null` (a full q_proj) becomes 0. llama.cpp's DEEPSEEK2 loader otherwise guesses "no low-rank
  query" from the layer count of DeepSeek's own lite models only, and refuses the missing key.
- `n_routed_experts: 1` becomes 2 (with `n_group`, `topk_group`, `num_experts_per_tok` 1): llama.cpp asserts
  fewer expert groups than experts. No expert is ever built: `first_k_dense_replace` equals the layer count,
  so every layer is dense.
Refused with the reason, before anything is written: MoE layers (ecomla never writes them), qk_nope_head_dim 0
(llama.cpp's DEEPSEEK2 graph asserts it is at least 1 and aborts the process while loading), a tokenizer whose
pre-tokenizer llama.cpp's converter does not know (its own message is passed on).

One difference remains and is measured, not hidden: transformers' `kv_a_layernorm` (the latent RMSNorm) uses
ε = 1e-6, while llama.cpp uses the config's `rms_norm_eps` for every norm (1e-5 for SmolLM2). The latent's
mean square is about 1, so the two differ by about 1e-5 relative; docs/serving.md has the measured effect.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Literal, get_args

from ecomla.errors import UserError

OutType = Literal["f32", "f16", "bf16", "q8_0"]
OUTTYPES: tuple[str, ...] = get_args(OutType)
LLAMA_CPP_VERSION = "0.3.36"  # the sdist whose converter is used when llama-cpp-python is not installed
CONVERTER = "convert_hf_to_gguf.py"
VENDORED = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # what is unpacked from vendor/llama.cpp/


class ExportError(UserError, ValueError):
    """A checkpoint that cannot be exported, or a converter that cannot be found or run."""


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version (its converter matches its engine), else the pinned one."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return LLAMA_CPP_VERSION


def cache_root() -> Path:
    """$ECOMLA_CACHE, default ~/.cache/ecomla: where unpacked converters live."""
    return Path(os.environ.get("ECOMLA_CACHE") or Path.home() / ".cache" / "ecomla")


def converter_dir(version: str | None = None) -> Path:
    """Where the unpacked converter of `version` (default: the installed one) lives: cache_root()/llama.cpp-V."""
    return cache_root() / f"llama.cpp-{version or llama_cpp_version()}"


def ensure_converter(directory: str | Path | None = None, *, quiet: bool = False) -> Path:
    """The directory holding `convert_hf_to_gguf.py`: `directory` if given, else the cache (filled on first use)."""
    if directory is not None:
        d = Path(directory)
        if not (d / CONVERTER).is_file():
            raise ExportError(f"{d} has no {CONVERTER}; pass a llama.cpp checkout (or leave --converter out to "
                              "use the one from the llama-cpp-python sdist)")
        return d
    version = llama_cpp_version()
    d = converter_dir(version)
    if (d / CONVERTER).is_file():
        return d
    if not quiet:
        print(f"fetching llama.cpp's converter: the llama-cpp-python {version} sdist from the package index "
              f"(about 75 MB, once) -> {d}", flush=True)
    d.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d.parent, prefix=f".{d.name}.") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
               "--no-deps", "--quiet", "--dest", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            raise ExportError(f"could not download the llama-cpp-python {version} sdist ({' '.join(cmd)}):\n"
                              f"{proc.stderr.strip()[-1500:]}\nWith no package index, unpack a llama.cpp checkout "
                              "and pass --converter DIR")
        unpacked = Path(tmp) / "unpacked"
        _unpack_vendored(sdists[0], unpacked)
        (unpacked / "source.json").write_text(json.dumps({"package": "llama-cpp-python", "version": version,
                                                           "sdist": sdists[0].name}, indent=2) + "\n")
        unpacked.rename(d)  # whole or not at all: an interrupted download leaves no converter directory
    return d


def _unpack_vendored(sdist: Path, out: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts  # llama_cpp_python-V / vendor / llama.cpp / ENTRY / ...
            if len(parts) >= 4 and parts[1:3] == ("vendor", "llama.cpp") and parts[3] in VENDORED and \
                    (m.isfile() or m.isdir()):
                m.name = str(Path(*parts[3:]))
                members.append(m)
        tar.extractall(out, members=members, filter="data")
    if not (out / CONVERTER).is_file():
        raise ExportError(f"{sdist.name} has no vendor/llama.cpp/{CONVERTER}")


def converter_config(config: dict) -> tuple[dict, list[str]]:
    """The config.json llama.cpp's converter should read, and a line per change made (see the module docstring)."""
    cfg = dict(config)
    notes: list[str] = []
    if not cfg.get("architectures"):  # the converter picks its model class by this field alone
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type"))
        if arch is None:
            raise ExportError(f"config.json names no architectures and model_type {cfg.get('model_type')!r} has no "
                              "causal-LM class in transformers; add \"architectures\" to config.json")
        cfg["architectures"] = [arch]
        notes.append(f"architectures missing -> [{arch}] (from model_type)")
    if cfg.get("model_type") != "deepseek_v3":
        return cfg, notes
    layers = cfg["num_hidden_layers"]
    if (cfg.get("qk_nope_head_dim") or 0) < 1:
        raise ExportError(f"qk_nope_head_dim is {cfg.get('qk_nope_head_dim')}: llama.cpp's DEEPSEEK2 graph asserts "
                          "qk_nope_head_dim >= 1 and aborts the process while loading such a file, so no GGUF is "
                          "written. Convert with some no-RoPE key dims: mla.qk_rope_head_dim below the head dim, or, "
                          "for a source with several KV heads, mla.rope_key rorope_act (its residual adds d_r of them); "
                          "mla.serve_with: llama.cpp refuses such a recipe before converting")
    if cfg.get("first_k_dense_replace", 0) < layers:
        raise ExportError(f"first_k_dense_replace is {cfg.get('first_k_dense_replace')} of {layers} layers: MoE "
                          "layers; ecomla exports the dense DeepSeek-V3 checkpoints it writes, not MoE models")
    if cfg.get("q_lora_rank") is None:
        cfg["q_lora_rank"] = 0
        notes.append("q_lora_rank null -> 0 (llama.cpp reads 0 as the full attn_q)")
    if (cfg.get("n_routed_experts") or 0) < 2:
        cfg.update(n_routed_experts=2, n_group=1, topk_group=1, num_experts_per_tok=1)
        notes.append("n_routed_experts -> 2, n_group 1 (llama.cpp asserts n_group < n_expert; every layer is "
                     "dense, so no expert is built)")
    return cfg, notes


def export_gguf(checkpoint: str | Path, out: str | Path, *, outtype: OutType = "f16",
                converter: str | Path | None = None, force: bool = False, quiet: bool = False) -> Path:
    """Write `checkpoint` as the GGUF file `out` with llama.cpp's converter; returns `out`."""
    src, out = Path(checkpoint), Path(out)
    if outtype not in OUTTYPES:
        raise ExportError(f"--outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    if not (src / "config.json").is_file():
        raise ExportError(f"{src} is not a Hugging Face checkpoint directory (no config.json)")
    if out.suffix != ".gguf":
        raise ExportError(f"{out}: the output must be a .gguf file name")
    if out.exists() and not force:
        raise ExportError(f"{out} already exists; pass --force to replace it")
    config, notes = converter_config(json.loads((src / "config.json").read_text()))
    conv = ensure_converter(converter, quiet=quiet)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    with tempfile.TemporaryDirectory(prefix="ecomla-gguf-") as tmp:
        view = Path(tmp) / src.name  # the converter names the model after its directory
        view.mkdir()
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json":
                (view / f.name).symlink_to(f.resolve())
        (view / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for note in notes if not quiet else ():
            print(f"converter input: {note}", flush=True)
        cmd = [sys.executable, str(conv / CONVERTER), str(view), "--outfile", str(partial), "--outtype", outtype]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = proc.stderr.strip()[-2500:]
        if "pre-tokenizer" in tail or "get_vocab_base_pre" in tail:
            raise ExportError(f"llama.cpp's converter does not know this tokenizer's pre-tokenizer, so llama.cpp "
                              f"would tokenize differently; {src} cannot be exported as it is:\n{tail}")
        raise ExportError(f"llama.cpp's converter failed on {src} ({' '.join(cmd)}):\n{tail}")
    partial.replace(out)
    if not quiet:
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {outtype})", flush=True)
    return out
