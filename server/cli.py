"""The ``fusetune`` command: ``serve``, ``submit``, ``status``, ``demo`` and ``simulate``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from typing import Any

import uvicorn

from fusetune.client import Client, FusetuneError
from fusetune.server.settings import Settings, get_settings

#: The demo sweep: lr, momentum and weight decay are fusible; the two hidden widths are not.
#: FusionSampler picks one width per group of max_array_size trials: two arrays of eight.
DEMO_SWEEP: dict[str, Any] = {
    "workload": "digits-mlp",
    "n_trials": 16,
    "epochs": 15,
    "sampler": {"name": "TPESampler", "kwargs": {"seed": 7}},
    "max_array_size": 8,
}


class BackgroundServer:
    """uvicorn serving the app in a thread of this process, for ``demo`` and tests."""

    def __init__(self, settings: Settings, schedule: bool = True) -> None:
        from fusetune.server.app import create_app

        app = create_app(settings, schedule=schedule)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = f"http://{settings.host}:{settings.port}"

    def start(self, timeout: float = 120.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the fusetune service did not start at {self.url}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def _print_trials(client: Client, study_id: int) -> None:
    print(f"{'#':>3} {'state':<9} {'array':>5} {'value':>7}  params")
    for t in client.trials(study_id):
        value = f"{t['value']:.4f}" if t["value"] is not None else "-"
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items())
        print(f"{t['number']:>3} {t['state']:<9} {t['array_id'] or '-':>5} {value:>7}  {params}")


def cmd_serve(args: argparse.Namespace) -> int:
    from fusetune.server.app import create_app

    settings = get_settings()
    uvicorn.run(create_app(settings), host=args.host or settings.host, port=args.port or settings.port)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    body = json.load(sys.stdin if args.file == "-" else open(args.file))
    with Client(args.url) as client:
        try:
            study = client.submit(body)
        except FusetuneError as exc:
            print(f"rejected: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(study, indent=2))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with Client(args.url) as client:
        if args.study_id is None:
            for s in client.studies():
                print(f"{s['id']:>4} {s['name']:<32} {s['state']:<9} {s['trial_counts']}")
            return 0
        study = client.study(args.study_id)
        print(f"study {study['id']} {study['name']}: {study['state']} {study['trial_counts']}")
        _print_trials(client, args.study_id)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import ray

    settings = get_settings()
    print(f"fusetune: database {settings.database_url}; starting the service and a local Ray instance ...")
    # Ray installs its signal handlers only from the main thread, not from uvicorn's.
    ray.init(address=settings.ray_address, include_dashboard=False, log_to_driver=False)
    server = BackgroundServer(settings).start()
    try:
        with Client(server.url) as client:
            started = time.monotonic()
            study = client.create_study(name=f"demo-{time.strftime('%Y%m%d-%H%M%S')}", **DEMO_SWEEP)
            print(f"submitted study {study['id']} ({study['name']}): {DEMO_SWEEP['n_trials']} digits-mlp trials")

            def progress(s: dict[str, Any]) -> None:
                c = s["trial_counts"]
                print(
                    f"  {time.monotonic() - started:6.1f}s  waiting {c['WAITING']:>2}  running {c['RUNNING']:>2}  "
                    f"complete {c['COMPLETE']:>2}  pruned {c['PRUNED']:>2}  failed {c['FAIL']:>2}",
                    flush=True,
                )

            study = client.wait(study["id"], timeout=args.timeout, poll=2.0, on_poll=progress)
            elapsed = time.monotonic() - started
            _print_trials(client, study["id"])
            print("\narrays:")
            for a in client.arrays(study["id"]):
                rate = f"{a['models_steps_per_s']:.0f} models·steps/s" if a["models_steps_per_s"] else ""
                print(f"  array {a['id']}: {a['size']} trials {a['trial_ids']} on {a['worker']} {a['state']} {rate}")
            best = study["best_trial"]
            print(f"\nsweep finished in {elapsed:.1f} s")
            if best:
                print(f"best trial #{best['number']}: accuracy {best['value']:.4f} with {best['params']}")
            print(f"\nAPI docs:  {server.url}/docs")
            print(f"trials:    {server.url}/api/v1/studies/{study['id']}/trials")
            print(f"Optuna:    optuna.load_study(study_name={study['name']!r}, storage={settings.database_url!r})")
        if args.exit:
            return 0
        print("\nserving until interrupted (Ctrl-C) ...", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="fusetune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    default_url = f"http://{get_settings().host}:{get_settings().port}"

    p = sub.add_parser("serve", help="run the service (API + scheduling loop)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("submit", help="submit a study from a JSON file ('-' for stdin)")
    p.add_argument("file")
    p.add_argument("--url", default=default_url)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="list studies, or one study's trials")
    p.add_argument("study_id", nargs="?", type=int)
    p.add_argument("--url", default=default_url)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("demo", help="start the service, run the demo sweep, keep serving")
    p.add_argument("--exit", action="store_true", help="exit when the sweep is done instead of serving")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=cmd_demo)

    sub.add_parser(
        "simulate",
        help="replay a cluster trace under every scheduling policy (python -m scheduler.sim)",
        add_help=False,
    )

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:
        from fusetune.scheduler import sim

        return sim.main(argv[1:])
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
