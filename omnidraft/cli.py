"""Command line: ``omnidraft [hydra overrides]`` and ``python -m omnidraft``.

Overrides are composed once up front so that a bad key, a bad type or an unknown group option
fails with one line and exit code 2 before Hydra starts a run. Errors raised while running
(OmniDraftError) also print one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return msg[0] if msg else type(e).__name__


def _fail(msg: str) -> None:
    print(f"omnidraft: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _precompose(argv: list[str]) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from omnidraft.config import register_configs

    if any(a.startswith("-") for a in argv):
        return  # --multirun, --cfg, --help ...: leave them to Hydra
    overrides = [a for a in argv if not a.split("=")[0].lstrip("+~").startswith("hydra")]
    register_configs()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose("config", overrides=overrides)
            from omnidraft.runner import check_config

            check_config(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        _fail(_explain(e))


def _explain(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = " ".join(lines[:3]) if lines else type(e).__name__
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        text += f" ({_first_line(cause)})"
    return text


def main() -> None:
    """Console entry point."""
    import hydra
    from omegaconf import DictConfig

    from omnidraft.config import register_configs
    from omnidraft.errors import OmniDraftError

    argv = sys.argv[1:]
    try:
        _precompose(argv)
    except OmniDraftError as e:
        _fail(_first_line(e))
    register_configs()

    @hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
    def _app(cfg: DictConfig) -> float | None:
        from omnidraft.runner import run

        try:
            summary = run(cfg)
        except OmniDraftError as e:
            _fail(_first_line(e))
        except KeyboardInterrupt:
            _fail("interrupted; metrics.jsonl and summary.json hold the prompts finished so far")
        return summary.get("speed/speedup", summary.get("accept/rate"))

    _app()


if __name__ == "__main__":
    main()
