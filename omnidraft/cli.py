"""Command line: ``omnidraft [hydra overrides]`` and ``python -m omnidraft``.

Subcommands: ``omnidraft distill [overrides]`` (DistillSpec's offline distillation, config
``conf/distill.yaml``), ``omnidraft bench [overrides]`` (methods compared in one process,
config ``conf/bench.yaml``), ``omnidraft trace [overrides]`` (the target's greedy decoding of a
task's prompts recorded for replay, config ``conf/trace.yaml``, :mod:`omnidraft.trace`),
``omnidraft calibrate [overrides]`` (this machine's forward latency of target and drafter, which a
replay's modelled speed reads, config ``conf/calibrate.yaml``, :mod:`omnidraft.calibrate`) and
``omnidraft tables {core,adaptive,bench} [--results DIR]``
(``<results>/<group>/table.md`` from the result files, :mod:`omnidraft.tables`; no config) and
``omnidraft plan <sweep overrides> [--out=FILE]`` (what a sweep still has to run and its cost in
core-hours, from the result files, :mod:`omnidraft.plan`).

Overrides are composed once up front so that a bad key, a bad type or an unknown group option
fails with one line and exit code 2 before Hydra starts a run. Errors raised while running
(OmniDraftError) also print one line.
"""

from __future__ import annotations

import itertools
import sys

from omnidraft.config import CONF_DIR


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return msg[0] if msg else type(e).__name__


def _fail(msg: str) -> None:
    print(f"omnidraft: error: {msg}", file=sys.stderr)
    sys.exit(2)


# Hydra's command-line modes, by each of their spellings: one per command.
_MODES = {"-m": "--multirun", "--multirun": "--multirun", "-c": "--cfg", "--cfg": "--cfg", "-r": "--run",
          "--run": "--run", "-i": "--info", "--info": "--info", "-sc": "--shell-completion",
          "--shell-completion": "--shell-completion"}


def _check_hydra_flags(argv: list[str]) -> None:
    """Parse the command line's flags the way Hydra will, so that a bad one (``--cfg jb``, ``--bogus``)
    fails in one line: argparse's own refusal prints a usage block before its line."""
    import contextlib
    import io

    try:
        from hydra._internal.utils import get_args_parser
    except ImportError:  # another Hydra layout: its own parser will refuse it
        return
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            get_args_parser().parse_args(argv)
    except SystemExit as e:
        if e.code:  # 0 is --version: Hydra prints it itself
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            msg = lines[-1].split("error: ", 1)[-1] if lines else f"bad flag in: {' '.join(argv)}"
            if msg.startswith("unrecognized arguments: ") and not msg.split(": ", 1)[1].startswith("-"):
                _fail(f"{msg}: overrides on both sides of a flag; put -m (--cfg, ...) before or after all of them")
            _fail(f"{msg}; `omnidraft --help` lists the flags")


def _precompose(argv: list[str], config_name: str = "config") -> None:
    """Compose the run's config (every job's, for a sweep) and check it, so that a bad key, value or
    group option fails in one line before any model loads or any job of a sweep starts.

    Args:
        argv: the command line's overrides and flags.
        config_name: the primary config of the (sub)command.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from omnidraft.config import register_configs
    from omnidraft.errors import OmniDraftError

    flags = [a for a in argv if a.startswith("-")]
    modes = {_MODES[f.split("=")[0]] for f in flags if f.split("=")[0] in _MODES}
    if len(modes) > 1:  # Hydra's own refusal is a traceback
        raise OmniDraftError(f"{' and '.join(sorted(modes))}: Hydra takes one of them per command; "
                             "drop all but one")
    if any(f not in ("-m", "--multirun") for f in flags):
        return  # --cfg, --help, --info ...: leave them to Hydra
    args = [a for a in argv if not a.startswith("-")]
    hydra_args = [a for a in args if a.split("=")[0].lstrip("+~").startswith("hydra")]
    overrides = [a for a in args if a not in hydra_args]
    register_configs()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            _check_added_keys(overrides, compose, config_name)
            if not flags:
                _check_not_a_sweep(args, compose, config_name)
            jobs = sweep_jobs(overrides, compose, config_name) if flags else [overrides]
            for job in jobs:
                _CHECKS[config_name](compose(config_name, overrides=job))
            if hydra_args:  # a launcher, its keys, the run/sweep dirs: Hydra's own config, once
                compose(config_name, overrides=jobs[0] + hydra_args, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        _fail(_explain(e))


def _check_not_a_sweep(args: list[str], compose, config_name: str) -> None:
    """Refuse an experiment run without ``-m``: its settings (rows, temperature, engine ...) sit in
    its ``hydra.sweeper.params``, which only a multirun applies, so one run would silently be
    another setting."""
    from omnidraft.errors import OmniDraftError

    exp = next((a.split("=", 1)[1] for a in args if "=" in a and a.split("=")[0].lstrip("+~") == "experiment"), None)
    if exp is None:
        return
    params = dict(compose(config_name, overrides=args, return_hydra_config=True).hydra.sweeper.get("params") or {})
    if params:
        raise OmniDraftError(f"experiment={exp} is a sweep: its settings ({', '.join(params)}) apply only in a "
                             f"multirun; add -m (one job: omnidraft -m {' '.join(args)} row=<row> seed=<seed>)")


def _hint(e: BaseException) -> str:
    """The fix for a Hydra error whose own text does not say it."""
    if "hydra/launcher/ray" in str(e):
        return "; the Ray launcher is the optional extra: pip install -e '.[ray]'"
    if "Could not find 'experiment/" in str(e):  # Hydra lists no options of a nested group
        from pathlib import Path

        root = Path(CONF_DIR) / "experiment"
        names = sorted(str(f.relative_to(root).with_suffix("")) for f in root.rglob("*.yaml"))
        return f"; the experiments are: {', '.join(names)}"
    return ""


def _check_added_keys(overrides: list[str], compose, config_name: str) -> None:
    """Refuse ``+key=value`` where ``key``'s parent is a schema node: the schema names every key it
    has, so an added one is a typo that would be saved into config.yaml and read by nothing.
    Adding into an open mapping (``+bench.variants.x=...``, a drafter's kwargs) stays allowed.

    Raises:
        OmniDraftError: naming the key, the closest schema keys and the fix.
    """
    import difflib
    from pathlib import Path

    from omegaconf import OmegaConf

    from omnidraft.errors import OmniDraftError

    added = [o for o in overrides if o.startswith("+") and "=" in o]
    if not added:
        return
    rest = [o for o in overrides if o not in added and "," not in o]
    cfg = compose(config_name, overrides=rest)
    for o in added:
        key = o.split("=", 1)[0].lstrip("+")
        if (Path(CONF_DIR) / key.replace(".", "/").split("@")[0]).is_dir():
            continue  # `+group=option` appends a config group (`+bench_suite=...`)
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if not OmegaConf.is_dict(parent) or leaf in parent:
            continue
        if OmegaConf.get_type(parent) in (dict, None):
            continue  # an open mapping: adding is what `+` is for
        near = difflib.get_close_matches(leaf, [str(k) for k in parent.keys()], n=3)
        prefix = f"{parent_key}." if parent_key else ""
        hint = f" (did you mean {', '.join(prefix + k for k in near)}?)" if near else ""
        raise OmniDraftError(f"{o.split('=', 1)[0]}: the config has no key {key!r}{hint}; drop the override or fix "
                             "its name (`omnidraft --cfg job` prints every key)")


def _probe_dir(path) -> None:
    """Create ``path`` if needed and write a file there (raises OSError where this process cannot)."""
    import tempfile

    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path):
        pass


def _check_run_dir(argv: list[str]) -> None:
    """A ``hydra.run.dir`` / ``hydra.sweep.dir`` given on the command line must be a directory this
    process can write, checked before Hydra creates it (its own failure is a traceback)."""
    from pathlib import Path

    multirun = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir=" if multirun else "hydra.run.dir="
    for a in argv:
        if not a.startswith(key):
            continue
        if "${" in a:
            continue  # an interpolation Hydra resolves (${now:...}): checked by Hydra when it creates it
        path = Path(a[len(key):])
        try:
            _probe_dir(path)
        except OSError as e:
            _fail(f"{a}: cannot write there ({e.strerror or type(e).__name__}); choose a writable directory")


# Sweep dimensions that cannot make a config invalid: one value of each is checked.
_UNCHECKED_DIMS = ("seed",)


def sweep_jobs(overrides: list[str], compose, config_name: str = "config", every_value: bool = False
               ) -> list[list[str]]:
    """The override lists of a sweep's jobs, as Hydra's basic sweeper builds them: the config's
    ``hydra.sweeper.params`` (an experiment's sweep) under the command line's overrides (the
    command line wins for a key both set), every ``a=x,y`` / ``range()`` / ``choice()`` expanded into
    the cartesian product. Dimensions in :data:`_UNCHECKED_DIMS` take their first value in the product
    and each later value on its first job only, unless ``every_value`` (the sweep's jobs, not the
    configs to check).

    Args:
        overrides: the command line's overrides (no ``hydra.*`` keys).
        compose: ``hydra.compose`` inside an initialised config directory.
        config_name: the primary config.
    """
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    given = parser.parse_overrides(overrides)
    first = [o.input_line if not o.is_sweep_override() else
             f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" for o in given]
    hcfg = compose(config_name, overrides=first, return_hydra_config=True)
    params = dict(hcfg.hydra.sweeper.get("params") or {})
    keys = {o.get_key_element().lstrip("+~") for o in given}
    lines = [f"{k}={v}" for k, v in params.items() if str(k).lstrip("+~") not in keys] + list(overrides)
    dims, rest = [], []  # rest: (dimension, value) of the unchecked dimensions' later values
    for o in parser.parse_overrides(lines):
        key = o.get_key_element()
        if not o.is_sweep_override():  # Hydra's basic sweeper's form (1e-3 -> 0.001): its job directories' names
            dims.append([f"{key}={o.get_value_element_as_str()}"])
            continue
        values = list(o.sweep_string_iterator())
        if key.lstrip("+~") in _UNCHECKED_DIMS and not every_value:
            rest += [(len(dims), f"{key}={v}") for v in values[1:]]
            values = values[:1]
        dims.append([f"{key}={v}" for v in values])
    jobs = [list(job) for job in itertools.product(*dims)]
    for i, item in rest:  # each later value once, on the first job: a bad seed fails before any job starts
        jobs.append(jobs[0][:i] + [item] + jobs[0][i + 1:])
    return jobs


def _explain(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    lines = list(itertools.takewhile(lambda ln: not ln.startswith("Config search path"), lines))  # Hydra's, not ours
    text = " ".join(lines[:3]) if lines else type(e).__name__
    at = next((i for i, ln in enumerate(lines) if ln.startswith("Available options in")), None)
    if at is not None:  # a missing group option: Hydra lists every option, a line each
        text = " ".join(lines[:at + 1] + [", ".join(lines[at + 1:])])
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        text += f" ({_first_line(cause)})"
    return text + _hint(e)


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
    """``omnidraft tables GROUP [--results DIR]``: write and print ``<results>/<group>/table.md``;
    ``omnidraft tables DIR``: the paper tables of the experiment runs under DIR (a sweep directory
    or a results directory), written into DIR (:mod:`omnidraft.paper_tables`); ``omnidraft tables DIR
    --overview``: DIR/overview.md, every paper table under DIR at a glance.

    Args:
        argv: the arguments after ``tables``.
    """
    import argparse
    from pathlib import Path

    from omnidraft.errors import OmniDraftError
    from omnidraft.tables import GROUPS, write_table

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # argparse's own: a usage block, then its line
            _fail(f"tables: {message}; see omnidraft tables --help")

    p = _Parser(prog="omnidraft tables", description="Markdown tables from result files.")
    p.add_argument("group", help=f"one of {', '.join(GROUPS)}, or a directory of paper-experiment runs")
    p.add_argument("--results", type=Path, default=Path("results"), help="the results directory (default: results)")
    p.add_argument("--no-plots", action="store_true", help="paper tables: skip the PNG plots")
    p.add_argument("--overview", action="store_true",
                   help="paper tables: write DIR/overview.md, every table under DIR at a glance (seeds, pairs "
                        "against the paper), from the tables' JSON files; the tables themselves are left as they are")
    p.add_argument("--speed-machine", metavar="MACHINE", default=None,
                   help="paper tables: model every replay's speed with this machine's latency calibrations (its "
                        "file-name slug, e.g. intel-xeon-processor-amx), so cells run on different machines compare")
    args = p.parse_args(argv)
    try:
        if args.overview:
            from omnidraft.paper_tables import write_overview

            path = write_overview(Path(args.group))
            print(path.read_text(encoding="utf-8"))
            return
        if args.group not in GROUPS and (Path(args.group).is_dir() or "/" in args.group):
            from omnidraft.paper_tables import write_paper_tables

            for f in write_paper_tables(Path(args.group), plots=not args.no_plots, speed_machine=args.speed_machine):
                print(f)
            return
        if args.speed_machine:
            _fail(f"--speed-machine={args.speed_machine}: only paper tables model speed again; pass a directory of "
                  f"paper-experiment runs (results/paper/<table>/<scale>), not {args.group}")
        _, text = write_table(args.group, args.results)
    except OmniDraftError as e:
        _fail(_first_line(e))
    print(text)


def _plan(argv: list[str]) -> None:
    """``omnidraft plan <sweep overrides> [--out=FILE]``: every job of the sweep ``omnidraft -m <same
    overrides>`` would run, its state in the results directory and its cost (:mod:`omnidraft.plan`)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from omnidraft.config import register_configs
    from omnidraft.errors import OmniDraftError
    from omnidraft.plan import Job, classify, estimate, finished_runs, override_dirname, render, summary_of, to_json

    out = next((a.split("=", 1)[1] for a in argv if a.startswith("--out=")), None)
    overrides = [a for a in argv if not a.startswith("-")]
    bad = [a for a in argv if a.startswith("-") and not a.startswith("--out=")]
    if bad:
        _fail(f"plan: unknown flag {bad[0]}; use: omnidraft plan <sweep overrides> [--out=FILE]")
    if not any(o.split("=", 1)[0] == "experiment" for o in overrides):
        _fail("plan: name the sweep, e.g. omnidraft plan experiment=paper/table1 scale=cpu seed=0,1,2")
    if out:
        _check_writable(Path(out), "--out=")
    register_configs()
    jobs = []
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            for job in sweep_jobs(overrides, compose, every_value=True):
                h = compose("config", overrides=job, return_hydra_config=True)
                od = h.hydra.job.config.override_dirname
                name = override_dirname(job, list(od.exclude_keys), od.kv_sep, od.item_sep)
                run_dir = Path(h.hydra.sweep.dir) / name
                cfg = compose("config", overrides=job)
                with open_dict(cfg):
                    cfg.run_dir = str(run_dir)  # set, not an override: the name may hold any character
                frozen = _seed_independent(cfg)
                row = next((o.split("=", 1)[1] for o in job if o.startswith("row=")), None)
                j = Job(job, run_dir, name, row, str(cfg.task.name), trains=not frozen, target=str(cfg.target.name),
                        evals=_evaluations(cfg), engine=str(cfg.get("engine") or "live"), **_prompt_counts(cfg))
                stands = int(cfg.get("seed", 0)) != 0 and frozen
                # the sweep copies a shared cell unless the job finished or has a state to resume
                src = None if stands or summary_of(run_dir).get("status") == "ok" or (run_dir / "state" / "meta.json").is_file() \
                    else find_shared_cell(cfg, run_dir)[0]
                jobs.append(classify(j, stands, str(src) if src else None))
                paper_dir, scale = Path(cfg.paths.results_dir) / "paper", str(h.hydra.runtime.choices.get("scale"))
    except (HydraException, OmegaConfBaseException) as e:
        _fail(_explain(e))
    except OmniDraftError as e:
        _fail(_first_line(e))
    estimate(jobs, finished_runs(paper_dir, scale) if jobs else [])
    command = "omnidraft -m " + " ".join(overrides)
    text = render(jobs, command)
    if out:  # FILE and, beside it, FILE's stem + .json (the same plan as data; results/paper/overview.md reads it)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text, encoding="utf-8")
        if Path(out).suffix != ".json":
            import json

            Path(out).with_suffix(".json").write_text(json.dumps(to_json(jobs, command), indent=1) + "\n",
                                                      encoding="utf-8")
            papers = Path(out).parent.parent  # results/paper/plans/<t>_<scale>.md: keep results/paper's overview true
            if (papers / "overview.md").is_file():
                from omnidraft.paper_tables import write_overview

                try:
                    write_overview(papers)
                except OmniDraftError as e:  # the plan is written; the overview waits for the tables
                    print(f"omnidraft: warning: {papers / 'overview.md'} not written again: {_first_line(e)}",
                          file=sys.stderr)
    print(text)


def _check_writable(path, flag: str) -> None:
    """A file the command will write at its end: its directory must take a new file now, before the work."""
    try:
        _probe_dir(path.parent)
        if path.is_dir():
            raise IsADirectoryError(21, "a directory")
    except OSError as e:
        _fail(f"{flag}{path}: cannot write there ({e.strerror or type(e).__name__}); choose a writable file")


def _metric(summary: dict) -> float | None:
    """The number a sweeper optimises: the speedup, else the acceptance rate (distill: its loss)."""
    return summary.get("speed/speedup", summary.get("speed/modelled_speedup", summary.get(
        "accept/rate", summary.get("distill/loss_after"))))


def _in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _learns_online(cfg) -> bool:
    """Whether the drafter or its acceptance head trains on the stream (the n-gram cache aside)."""
    m = cfg.get("method")
    if m is None:
        return False
    learns = m.get("can_adapt") and m.adapt.enabled
    head = m.get("draft_length") is not None and m.draft_length.policy == "head" and m.draft_length.head_learn
    return bool(learns or head)


def _evaluations(cfg) -> int | None:
    """How many frozen test evaluations a ``protocol=train_test`` run of ``cfg`` makes (None for other
    protocols), as the runner schedules them (:func:`omnidraft.config.evaluation_points`)."""
    from omnidraft.config import decoding_learns, evaluation_points

    if cfg.get("protocol") != "train_test":
        return None
    t = cfg.train_test
    return len(evaluation_points(int(t.train_limit), int(t.eval_every), bool(t.eval_at_start),
                                 decoding_learns(cfg.method)))


def _prompt_counts(cfg) -> dict[str, int | None]:
    """The prompts a run of ``cfg`` decodes: its stream's (``protocol=train_test``: the train prompts,
    none when nothing learns online) and one test evaluation's (train_test only); None: unknown."""
    from omnidraft.config import decoding_learns

    limit = cfg.task.get("limit")
    if cfg.get("protocol") != "train_test":
        return {"stream_prompts": None if limit is None else int(limit), "test_prompts": None}
    return {"stream_prompts": int(cfg.train_test.train_limit) if decoding_learns(cfg.method) else 0,
            "test_prompts": None if limit is None else int(limit)}


def _seed_independent(cfg) -> bool:
    """A cell whose result no seed can change: greedy, and no drafter or acceptance head trains,
    online or (DistillSpec under train_test) offline (the n-gram cache's learning is deterministic
    under greedy decoding)."""
    m = cfg.get("method")
    if m is None or "temperature" not in m or m.temperature > 0:
        return False
    # DistillSpec under train_test distils on the train slice first, in a seeded order
    distils = m.get("needs_init_state") and cfg.get("protocol") == "train_test" and not (cfg.get("drafter") or {}).get("init_state")
    if distils:
        return False
    return not _learns_online(cfg)


def find_shared_cell(cfg, run_dir):
    """The directory of a finished run elsewhere under ``<paths.results_dir>/paper/`` with this job's
    result identity, with its summary; (None, None) if none. The same identity: the summary's
    ``cell`` is this job's :func:`omnidraft.lifecycle.cell_key`, or, whatever code version wrote
    that key, its ``config.yaml`` holds this job's config (:func:`omnidraft.lifecycle.same_cell`)."""
    import json
    from pathlib import Path

    import yaml

    from omnidraft.lifecycle import cell_fingerprint, fingerprint_key, same_cell

    root = Path(cfg.paths.results_dir)
    fp = key = None
    for f in sorted((root / "paper").glob("*/*/*/summary.json")):
        if f.parent.resolve() == Path(run_dir).resolve():
            continue
        try:
            s = json.loads(f.read_text(encoding="utf-8"))
        except ValueError:
            continue
        if s.get("status") != "ok" or not s.get("cell") or s.get("shared_from"):
            continue
        if fp is None:
            fp = cell_fingerprint(cfg)
            key = fingerprint_key(fp)
        if s["cell"] == key:
            return f.parent, s
        try:
            written = yaml.safe_load((f.parent / "config.yaml").read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(written, dict) and same_cell(written, fp):
            return f.parent, s
    return None, None


def shared_cell(cfg, run_dir) -> dict | None:
    """A finished run elsewhere under ``<paths.results_dir>/paper/`` with this job's result identity
    (:func:`omnidraft.lifecycle.cell_key`: the same resolved config and seed; e.g. Table 6's and
    Table 3's ``hybrid`` on GSM8K are Table 1's cell), copied into ``run_dir`` instead of run again:
    its rows, provenance and config, its summary with this job's group choices and ``shared_from``
    (the source, relative to the results directory). Returns the summary, or None when there is no
    such run."""
    import shutil
    from pathlib import Path

    from omnidraft.lifecycle import group_choices, write_json

    src, s = find_shared_cell(cfg, run_dir)
    if src is None:
        return None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "provenance.json", "config.yaml"):
        if (src / name).is_file():
            shutil.copyfile(src / name, run_dir / name)
    s = {**s, "choices": group_choices() or s.get("choices"),
         "shared_from": str(src.relative_to(Path(cfg.paths.results_dir)))}
    write_json(run_dir / "summary.json", s)
    return s


def _sweep_job(config_name: str, cfg) -> float | None:
    """One job of a sweep (``omnidraft -m ...``), robust: a job whose ``summary.json`` says it
    finished is skipped (a sweep re-run does only what is missing), one with a saved online state
    resumes from it, a seed-independent cell (:func:`_seed_independent`) runs at seed 0 only, a cell
    another table already computed is copied (:func:`shared_cell`), and a
    job that fails writes ``error.txt`` in its directory, prints one line and lets the sweep go on.
    Ctrl-C / SIGTERM stops the sweep."""
    import json
    import traceback
    from pathlib import Path

    from omegaconf import open_dict

    from omnidraft.errors import OmniDraftError

    run_dir = Path(cfg.run_dir)
    done = run_dir / "summary.json"
    if done.is_file():
        try:
            summary = json.loads(done.read_text(encoding="utf-8"))
        except ValueError:
            summary = {}
        if summary.get("status") == "ok":
            print(f"omnidraft: sweep: {run_dir}: finished earlier, skipped", file=sys.stderr)
            return _metric(summary)
    if config_name == "config" and int(cfg.get("seed", 0)) != 0 and _seed_independent(cfg):
        print(f"omnidraft: sweep: {run_dir}: seed-independent (greedy, nothing learns): its seed=0 cell "
              "stands for every seed, skipped", file=sys.stderr)
        return None
    if config_name == "config" and not (run_dir / "state" / "meta.json").is_file():
        shared = shared_cell(cfg, run_dir)
        if shared is not None:
            print(f"omnidraft: sweep: {run_dir}: the same cell finished in {shared['shared_from']}: copied, "
                  "not run again", file=sys.stderr)
            return _metric(shared)
    if config_name == "config" and not cfg.resume and (run_dir / "state" / "meta.json").is_file():
        with open_dict(cfg):
            cfg.resume = True  # a cut job continues from its last checkpoint
    (run_dir / "error.txt").unlink(missing_ok=True)
    try:
        return _metric(_run(config_name, cfg))
    except KeyboardInterrupt:
        _fail(f"interrupted in {run_dir}; run the same sweep again to continue (finished jobs are skipped)")
    except Exception as e:  # noqa: BLE001 - a failed job must not stop the sweep
        line = _first_line(e)
        run_dir.mkdir(parents=True, exist_ok=True)
        detail = "" if isinstance(e, OmniDraftError) else "\n" + traceback.format_exc()
        (run_dir / "error.txt").write_text(f"{line}{detail}\n", encoding="utf-8")
        print(f"omnidraft: error: {run_dir}: {line} (the sweep goes on; {run_dir / 'error.txt'})", file=sys.stderr)
        return None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    """Console entry point."""
    if sys.argv[1:2] == ["tables"]:  # reads result files: no Hydra config, no run directory
        _tables(sys.argv[2:])
        return
    if sys.argv[1:2] == ["plan"]:  # composes a sweep's jobs and reads result files: no run directory
        _plan(sys.argv[2:])
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
    _check_hydra_flags(argv)
    try:
        _precompose(argv, config_name)
    except OmniDraftError as e:
        _fail(_first_line(e))
    _check_run_dir(argv)
    register_configs()

    @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
    def _app(cfg: DictConfig) -> float | None:
        if _in_sweep():
            return _sweep_job(config_name, cfg)
        try:
            summary = _run(config_name, cfg)
        except OmniDraftError as e:
            _fail(_first_line(e))
        except KeyboardInterrupt:
            _fail("interrupted; the run directory's metrics.jsonl and summary (bench: results JSON) "
                  "hold the prompts finished so far")
        return _metric(summary)

    _app()


if __name__ == "__main__":
    main()
