"""Command line: ``omnidraft [hydra overrides]`` and ``python -m omnidraft``.

Subcommands: ``omnidraft distill [overrides]`` (DistillSpec's offline distillation, config
``conf/distill.yaml``), ``omnidraft bench [overrides]`` (methods compared in one process,
config ``conf/bench.yaml``), ``omnidraft trace [overrides]`` (the target's greedy decoding of a
task's prompts recorded for replay, config ``conf/trace.yaml``, :mod:`omnidraft.trace`),
``omnidraft calibrate [overrides]`` (this machine's forward latency of target and drafter, which a
replay's modelled speed reads, config ``conf/calibrate.yaml``, :mod:`omnidraft.calibrate`) and
``omnidraft tables {core,adaptive,bench} [--results DIR]``
(``<results>/<group>/table.md`` from the result files, :mod:`omnidraft.tables`; no config).

Overrides are composed once up front so that a bad key, a bad type or an unknown group option
fails with one line and exit code 2 before Hydra starts a run. Errors raised while running
(OmniDraftError) also print one line.
"""

from __future__ import annotations

import sys

from omnidraft.config import CONF_DIR


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return msg[0] if msg else type(e).__name__


def _fail(msg: str) -> None:
    print(f"omnidraft: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _precompose(argv: list[str], config_name: str = "config") -> None:
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
            cfg = compose(config_name, overrides=overrides)
            _CHECKS[config_name](cfg)
    except (HydraException, OmegaConfBaseException) as e:
        _fail(_explain(e))


def _explain(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = " ".join(lines[:3]) if lines else type(e).__name__
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        text += f" ({_first_line(cause)})"
    return text


def _check_run(cfg) -> None:
    from omnidraft.runner import check_config

    check_config(cfg)


def _check_distill(cfg) -> None:
    from omnidraft.distill_command import check_distill

    check_distill(cfg)


def _check_bench(cfg) -> None:
    from omnidraft.bench import check_bench

    check_bench(cfg)


def _check_trace(cfg) -> None:
    from omnidraft.trace import check_trace_config

    check_trace_config(cfg)


def _check_calibrate(cfg) -> None:
    from omnidraft.calibrate import check_calibrate_config

    check_calibrate_config(cfg)


_CHECKS = {"config": _check_run, "distill": _check_distill, "bench": _check_bench, "trace": _check_trace,
           "calibrate": _check_calibrate}


def _run(config_name: str, cfg):
    if config_name == "distill":
        from omnidraft.distill_command import run_distill

        return run_distill(cfg)
    if config_name == "trace":
        from omnidraft.trace import run_trace

        return run_trace(cfg)
    if config_name == "calibrate":
        from omnidraft.calibrate import run_calibrate

        return run_calibrate(cfg)
    if config_name == "bench":
        from omnidraft.bench import run_bench

        return run_bench(cfg)
    from omnidraft.runner import run

    return run(cfg)


def _tables(argv: list[str]) -> None:
    """``omnidraft tables GROUP [--results DIR]``: write and print ``<results>/<group>/table.md``.

    Args:
        argv: the arguments after ``tables``.
    """
    import argparse
    from pathlib import Path

    from omnidraft.errors import OmniDraftError
    from omnidraft.tables import GROUPS, write_table

    p = argparse.ArgumentParser(prog="omnidraft tables", description="Markdown tables from result files.")
    p.add_argument("group", help=f"one of {', '.join(GROUPS)}")
    p.add_argument("--results", type=Path, default=Path("results"), help="the results directory (default: results)")
    args = p.parse_args(argv)
    try:
        _, text = write_table(args.group, args.results)
    except OmniDraftError as e:
        _fail(_first_line(e))
    print(text)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    """Console entry point."""
    if sys.argv[1:2] == ["tables"]:  # reads result files: no Hydra config, no run directory
        _tables(sys.argv[2:])
        return
    import signal

    import hydra
    from omegaconf import DictConfig

    from omnidraft.config import register_configs
    from omnidraft.errors import OmniDraftError

    # SIGTERM (kill, SLURM's time limit) unwinds like Ctrl-C: summaries and results of the prompts
    # finished so far are written before the process exits.
    signal.signal(signal.SIGTERM, _interrupt)
    argv = sys.argv[1:]
    config_name = "config"
    if argv and argv[0] in ("distill", "bench", "trace", "calibrate"):
        config_name = argv.pop(0)
        sys.argv = [sys.argv[0]] + argv  # Hydra parses the overrides only
    try:
        _precompose(argv, config_name)
    except OmniDraftError as e:
        _fail(_first_line(e))
    register_configs()

    @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
    def _app(cfg: DictConfig) -> float | None:
        try:
            summary = _run(config_name, cfg)
        except OmniDraftError as e:
            _fail(_first_line(e))
        except KeyboardInterrupt:
            _fail("interrupted; the run directory's metrics.jsonl and summary (bench: results JSON) "
                  "hold the prompts finished so far")
        return summary.get("speed/speedup", summary.get("accept/rate", summary.get("distill/loss_after")))

    _app()


if __name__ == "__main__":
    main()
