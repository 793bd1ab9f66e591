"""The online state on disk (omnidraft.state): a checkpoint between two online updates reuses the
weights file the last one wrote, and never reuses one that holds other weights."""

from __future__ import annotations

import pytest
import torch

from omnidraft import state as state_io
from omnidraft.errors import OmniDraftError


def _state(w: float, version: str | None, buf: float = 0.0) -> state_io.SavedState:
    tensors = {"param.w": torch.full((64, 64), w), "opt.0.exp_avg": torch.full((64, 64), w / 2),
               "buffer.0.dm_logp": torch.full((3,), buf), "head_opt.0.exp_avg": torch.ones(2)}
    return state_io.SavedState({"next_index": int(buf)}, tensors, [{"i": int(buf)}], version)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_weights_are_written_once_per_version_and_read_back_with_the_rest(tmp_path):
    path = tmp_path / "state"
    state_io.save(path, _state(1.0, "run:0", buf=1))
    ino = (path / state_io.WEIGHTS).stat().st_ino
    second = _state(1.0, "run:0", buf=2)  # a prompt later, no update in between: only the small parts change
    state_io.save(path, second)
    assert (path / state_io.WEIGHTS).stat().st_ino == ino  # the same file, linked, not written again
    back = state_io.load(path)
    assert _same(back.tensors, second.tensors) and back.meta == second.meta and back.rows == second.rows
    # the small parts are apart from the weights (head_opt. is the head's, not the learner's)
    from safetensors.torch import load_file
    assert set(load_file(str(path / state_io.TENSORS))) == {"buffer.0.dm_logp", "head_opt.0.exp_avg"}

    third = _state(2.0, "run:1", buf=3)  # an update changed the weights: a new version, a new file
    state_io.save(path, third)
    assert (path / state_io.WEIGHTS).stat().st_ino != ino
    assert _same(state_io.load(path).tensors, third.tensors)


@pytest.mark.parametrize("version", [None, "another:1"])
def test_weights_without_a_matching_version_are_written_again(tmp_path, version):
    path = tmp_path / "state"
    state_io.save(path, _state(1.0, "run:1"))
    changed = _state(5.0, version, buf=1)  # other weights: no version, or another one
    state_io.save(path, changed)
    assert _same(state_io.load(path).tensors, changed.tensors)


def test_a_damaged_weights_file_is_not_reused_and_a_non_finite_one_is_refused(tmp_path):
    path = tmp_path / "state"
    state_io.save(path, _state(1.0, "run:0"))
    f = path / state_io.WEIGHTS
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # cut: its header no longer covers the file
    fixed = _state(1.0, "run:0", buf=1)
    state_io.save(path, fixed)
    assert _same(state_io.load(path).tensors, fixed.tensors)
    with pytest.raises(OmniDraftError, match="non-finite"):
        state_io.save(path, _state(float("nan"), "run:2", buf=2))
    assert _same(state_io.load(path).tensors, fixed.tensors)  # the last good checkpoint stays


def test_a_state_written_before_the_weights_file_existed_still_loads(tmp_path):
    from safetensors.torch import save_file

    old = _state(1.0, None, buf=1)
    path = tmp_path / "state"
    path.mkdir()
    save_file(old.tensors, str(path / state_io.TENSORS))  # one file for every tensor
    (path / state_io.META).write_text('{"next_index": 1}')
    assert _same(state_io.load(path).tensors, old.tensors)


def test_the_finiteness_check_flags_nan_inf_and_an_overflowing_sum_in_each_tensor():
    from omnidraft.learn.online import _all_finite

    ok = [torch.randn(5, 3), torch.randn(7, dtype=torch.bfloat16), torch.zeros(0)]
    assert state_io.finite_each(ok) == [True, True, True] and _all_finite(ok)
    assert state_io.finite_each([]) == [] and _all_finite([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        ts = [t.clone() for t in ok]
        ts[1][4] = bad  # one element of the bfloat16 tensor
        assert state_io.finite_each(ts) == [True, False, True], bad
        assert not _all_finite(ts)
    both = torch.tensor([1.0, float("inf"), -float("inf")])  # their sum is NaN, not a finite 0
    big = torch.full((4,), 3e38)  # finite elements, a sum beyond float32's range
    assert state_io.finite_each([both, big, ok[0]]) == [False, False, True]
    half = torch.full((4,), 6e4, dtype=torch.float16)  # finite, its float16 sum would overflow: summed in float32
    huge = torch.full((2,), 1e300, dtype=torch.float64)  # finite, beyond float32: summed in float64
    assert state_io.finite_each([half, huge, big.double()]) == [True, True, True]
