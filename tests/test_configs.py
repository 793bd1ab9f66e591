"""Every config file composes, and every _target_'s kwargs bind to its signature (no weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CONF_DIR
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from omnidraft.config import register_configs
from omnidraft.instantiate import iter_targets
from omnidraft.runner import check_config

GROUPS = ["target", "drafter", "task", "method", "logger", "paths", "debug", "experiment", "ablation", "pair", "row", "scale"]


def _options():
    for g in GROUPS:
        d = Path(CONF_DIR) / g
        if d.is_dir():
            for f in sorted(d.glob("*.yaml")):
                yield g, f.stem


def _compose(overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=["run_dir=unused", *overrides])


@pytest.mark.parametrize("group,option", list(_options()))
def test_every_config_composes_and_binds(group, option):
    over = [f"{group}={option}"]
    if (group, option) in (("method", "sd"), ("row", "sd")):
        over += ["drafter=qwen25_coder_05b"]
    if group == "method" and option == "distillspec":
        over += ["drafter.init_state=unused"]
    if group == "row" and option == "distillspec":  # a paper-table row: distilled on the train slice
        over += ["protocol=train_test"]
    cfg = _compose(over)
    check_config(cfg)  # binds every _target_ (method.drafter, loggers) to its signature
    if group == "method" and cfg.method.drafter is not None:
        assert [p for p, _ in iter_targets(cfg)] [:1] == ["method.drafter"]


def test_unknown_key_fails_before_loading():
    with pytest.raises(ConfigCompositionException):
        _compose(["method.kk=3"])


def test_wrong_type_fails_before_loading():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose(["method.k=five"])


def test_misspelled_target_kwarg_is_caught():
    from omnidraft.errors import OmniDraftError

    cfg = _compose(["+method.drafter.sync_lookbehnd=3"])
    with pytest.raises(OmniDraftError, match="sync_lookbehnd"):
        check_config(cfg)


@pytest.mark.parametrize("name", ["distill", "bench"])
def test_subcommand_configs_compose_and_check(name):
    from omnidraft.bench import check_bench
    from omnidraft.distill_command import check_distill

    register_configs()
    over = ["run_dir=unused"]
    if name == "bench":  # the default method list includes distillspec, which needs its checkpoint
        over.append("bench.method_overrides.distillspec=['drafter.init_state=results/distill/x/state']")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(name, overrides=over)
    if name == "distill":
        check_distill(cfg)
        assert cfg.task.offset == 200 and cfg.method.name == "distillspec"  # disjoint from the first 200
    else:
        check_bench(cfg)
        assert "ar" in cfg.bench.methods and set(cfg.bench.method_overrides) >= set(cfg.bench.methods)


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "fma", "avx512f"}, "float32"),  # AVX512 without BF16: torch emulates bf16
    ({"avx512f", "avx512_bf16"}, "bfloat16"),
    ({"amx_bf16", "amx_tile"}, "bfloat16"),
    ({"fp", "asimd", "bf16"}, "bfloat16"),  # aarch64 Features
    (set(), "float32"),
])
def test_auto_dtype_is_bf16_only_where_native(flags, expected):
    from omnidraft.data.models import parse_dtype, resolve_dtype

    assert resolve_dtype("auto", "cpu", flags) == expected
    assert resolve_dtype("float16", "cpu", flags) == "float16"  # explicit names pass through
    assert str(parse_dtype("float32")) == "torch.float32"


def test_bad_dtype_is_one_clear_error():
    from omnidraft.data.models import parse_dtype
    from omnidraft.errors import OmniDraftError

    with pytest.raises(OmniDraftError, match="'bf17'.*auto"):
        parse_dtype("bf17")


def test_resolve_dtypes_names_what_runs_here():
    """`auto` becomes this machine's concrete dtype before config.yaml and the resume fingerprint
    are written; an explicit dtype is kept."""
    from omnidraft.data.models import native_bf16
    from omnidraft.lifecycle import resolve_dtypes

    cfg = _compose(["target=qwen25_coder_15b", "drafter=smollm2_135m", "drafter.dtype=float16"])
    assert cfg.target.dtype == "auto"
    resolve_dtypes(cfg)
    assert cfg.target.dtype == ("bfloat16" if native_bf16("cpu") else "float32")
    assert cfg.drafter.dtype == "float16"


@pytest.mark.parametrize("suite", sorted(p.stem for p in (Path(CONF_DIR) / "bench_suite").glob("*.yaml")))
def test_every_bench_suite_composes_and_checks(suite):
    """A prepared bench (`omnidraft bench +bench_suite=<suite>`) passes the bench's checks, and each
    variant composes into its method with its own overrides applied."""
    from omegaconf import OmegaConf

    from omnidraft.bench import check_bench, method_config

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("bench", overrides=["run_dir=unused", f"+bench_suite={suite}"])
    check_bench(cfg)
    for label, v in cfg.bench.variants.items():
        c = method_config(label, cfg.bench.tasks[0], cfg, [])
        assert c.method.name == v.method, label
        for o in v.overrides:
            key, value = o.split("=", 1)
            assert str(OmegaConf.select(c, key)).lower() == value.lower(), (label, o)
