"""The schema's declared facts: allowed values in one module, method capabilities that agree with
the drafter classes, per-task head gamma in conf/task (no model loads)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from conftest import CONF_DIR
from hydra import compose, initialize_config_dir

from omnidraft import choices
from omnidraft.config import check_schema, register_configs, task_defaults
from omnidraft.errors import OmniDraftError
from omnidraft.instantiate import import_target

METHODS = sorted(f.stem for f in (Path(CONF_DIR) / "method").glob("*.yaml"))


def _compose(overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=["run_dir=unused", "debug=tiny", *overrides])


def test_choices_imports_nothing_from_the_package():
    """Every layer may import the allowed values, so their module depends on nothing."""
    tree = ast.parse(Path(choices.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert all(m == "__future__" for m in imported), imported


def test_the_divergence_names_are_the_implemented_ones():
    from omnidraft.learn.losses import DIVERGENCES

    assert tuple(DIVERGENCES) == choices.DIVERGENCES


@pytest.mark.parametrize("method", METHODS)
def test_method_capabilities_agree_with_the_drafter_class(method):
    """What a method declares (drafts_with, can_adapt, ...) is what its drafter class does."""
    from omnidraft.drafting.model_drafters import NgramDrafter, SameVocabDrafter

    m = _compose([f"method={method}"]).method
    if m.engine == "hf_assisted":
        assert m.hf.assistant == (m.drafts_with == "model")
        assert not (m.can_adapt or m.needs_same_tokenizer or m.needs_init_state)
        return
    if m.drafter is None:
        assert m.drafts_with == "none" and not m.can_adapt
        return
    cls = import_target(m.drafter._target_)
    assert m.drafts_with == ("model" if "model" in inspect.signature(cls).parameters else "lookup")
    ngram = issubclass(cls, NgramDrafter)
    assert m.can_adapt == ngram and m.lossless_sampling == (not ngram)
    assert m.needs_same_tokenizer == issubclass(cls, SameVocabDrafter)


@pytest.mark.parametrize("task,gamma", [("alpaca", 0.3), ("alpaca_sample", 0.3), ("xsum", 0.3), ("gsm8k", 0.7),
                                        ("mbpp", 0.7), ("humaneval", 0.7), ("mbpp_humaneval", 0.7),
                                        ("mt_bench", 0.7), ("synthetic", 0.7), ("no_such_task", 0.7)])
def test_head_gamma_is_a_task_fact(task, gamma):
    """SpecDec++'s per-task gamma lives in conf/task; a task without one (or without a YAML) gets 0.7."""
    assert task_defaults(task).head_gamma == gamma
    if task != "no_such_task":
        assert _compose([f"task={task}"]).task.head_gamma == gamma


@pytest.mark.parametrize("override,message", [
    ("method.verify=exact", "method.verify='exact': use one of lossless, paper"),
    ("method.drafts_with=gpu", "method.drafts_with='gpu': use one of model, lookup, none"),
    ("method.adapt.loss=kl", "method.adapt.loss='kl': use one of kl_nll"),
    ("method.adapt.train_dtype=float64", "method.adapt.train_dtype='float64'"),
    ("method.draft_length.policy=auto", "method.draft_length.policy='auto'"),
    ("method.draft_length.head_mode=both", "method.draft_length.head_mode='both'"),
    ("method.draft_length.head_label=t0", "method.draft_length.head_label='t0'"),
    ("method.draft_length.gamma=1.0", "method.draft_length.gamma=1.0 must be in (0, 1)"),
    ("method.adapt.jsd_beta=1.5", "method.adapt.jsd_beta=1.5 must be in [0, 1]"),
    ("task.head_gamma=0", "task.head_gamma=0.0 must be in (0, 1)"),
    ("distill.data=teacher", "distill.data='teacher'"),
    ("distill.epochs=0", "distill.epochs=0 must be >= 1"),
])
def test_a_bad_value_names_its_key_and_the_allowed_ones(override, message):
    cfg = _compose([override])
    with pytest.raises(OmniDraftError) as e:
        check_schema(cfg)
    assert message in str(e.value)


def test_every_method_config_passes_the_schema():
    for method in METHODS:
        check_schema(_compose([f"method={method}"]))
