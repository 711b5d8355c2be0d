"""The ``fusetune`` command: ``serve``, ``submit`` (``--code``: a study of the user's own code),
``status``, a study's ``pause``, ``resume``, ``cancel``, ``extend`` and ``delete``, ``tenants``,
``demo`` and ``simulate``."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import httpx
import uvicorn
from pydantic import SecretStr, ValidationError
from sqlalchemy.exc import OperationalError

from fusetune.client import Client, FusetuneError
from fusetune.server.api.connections import uvicorn_options
from fusetune.server.settings import Settings, get_settings
from fusetune.server.terminal import Inert

log = logging.getLogger("fusetune")
#: What ``fusetune --help`` says first (the module docstring is for readers of the code).
DESCRIPTION = (
    "fusetune: a hyper-parameter tuning service that trains many trials at once as horizontally "
    "fused models. 'fusetune COMMAND --help' describes each command."
)

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

        self.app = app = create_app(settings, schedule=schedule)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", **uvicorn_options(settings))
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
    if settings.admin_token is None:
        log.warning(
            "FUSETUNE_ADMIN_TOKEN is not set: no admin over HTTP. Every route still needs a tenant's "
            "token; create tenants with `fusetune tenants create NAME --database`."
        )
    uvicorn.run(
        create_app(settings), host=args.host or settings.host, port=args.port or settings.port,
        **uvicorn_options(settings),
    )
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    if args.code is None and (args.requirement or args.exclude):
        print("--requirement and --exclude go with --code", file=sys.stderr)
        return 2
    try:
        with (open(args.file) if args.file != "-" else contextlib.nullcontext(sys.stdin)) as f:
            body = json.load(f)
    except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError: not text at all
        print(f"{'stdin' if args.file == '-' else args.file} is not JSON: {exc}", file=sys.stderr)
        return 2
    with Client(args.url, token=args.token) as client:
        packaging = args.code is not None
        try:
            if args.code is not None:
                body = _with_package(client, body, args)
                packaging = False
            study = client.submit(body)
        except FusetuneError as exc:
            hint = " (uploading and running code takes the admin's code_upload grant)" if exc.status_code == 403 else ""
            print(f"rejected: {exc}{hint}", file=sys.stderr)
            return 2
        except (ValueError, TypeError, ImportError) as exc:  # what fusetune.client.package refuses
            print(f"cannot package the workload: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:
            if not packaging:
                raise
            # The user's own module raised (a SyntaxError, anything at import): its last frames are theirs.
            said = "".join(traceback.format_exception(exc, limit=-3)).rstrip()
            print(f"cannot package the workload: importing its module raised\n{said}", file=sys.stderr)
            return 2
    print(json.dumps(study, indent=2))
    return 0


def _with_package(client: Client, body: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``body`` for a study of the user's own code: its ``workload``, a ``module:attr`` path in
    ``--code``, packaged (with the body's ``search_space`` as the manifest's, when it has one)
    and uploaded unless the tenant has it; ``package`` names it, ``workload`` its workload's name."""
    from fusetune.client import package
    from fusetune.server.schemas import parse_search_space

    workload = body.get("workload") if isinstance(body, dict) else None
    if not isinstance(workload, str) or ":" not in workload:
        raise ValueError(f"with --code, the study's workload is a 'module:attr' path inside {args.code}, not {workload!r}")
    if body.get("package") is not None:
        raise ValueError("give --code or the body's package (a digest uploaded before), not both")
    space = body.get("search_space")
    if space is not None and not isinstance(space, dict):
        raise ValueError("search_space must be an object of Optuna distributions")
    pkg = package(
        workload, code=args.code, requirements=args.requirement, excludes=args.exclude,
        search_space=None if space is None else parse_search_space(space),
    )
    tenant = body.get("tenant")
    uploaded = client.ensure_package(pkg, tenant=tenant if isinstance(tenant, str) else None)
    print(
        f"package {pkg.digest} of {workload} (workload {pkg.workload_name!r}, {len(pkg.data)} bytes): "
        + ("uploaded" if uploaded else "uploaded before"),
        file=sys.stderr,
    )
    return {**body, "package": pkg.digest, "workload": pkg.workload_name}


def cmd_status(args: argparse.Namespace) -> int:
    try:
        return _status(args)
    except FusetuneError as exc:
        print(f"rejected: {exc}", file=sys.stderr)
        return 2


def _status(args: argparse.Namespace) -> int:
    with Client(args.url, token=args.token) as client:
        if args.study_id is None:
            for s in client.studies():
                print(f"{s['id']:>4} {s['name']:<32} {s['state']:<9} {s['trial_counts']}")
            return 0
        study = client.study(args.study_id)
        print(f"study {study['id']} {study['name']}: {study['state']} {study['trial_counts']}")
        if study.get("package"):
            print(f"package {study['package']}")
        for warning in study.get("warnings") or ():
            print(f"warning: {warning}")
        if study.get("error"):  # why it FAILED: a package's traceback included
            print(f"error: {study['error']}")
        _print_trials(client, args.study_id)
    return 0


def cmd_lifecycle(args: argparse.Namespace) -> int:
    """``pause``, ``resume``, ``cancel``, ``delete`` or ``extend`` one study; prints its state."""
    with Client(args.url, token=args.token) as client:
        try:
            if args.command == "extend":
                study = client.update_study(args.study_id, args.n_trials)
            else:
                study = getattr(client, f"{args.command}_study")(args.study_id)
        except FusetuneError as exc:
            print(f"rejected: {exc}", file=sys.stderr)
            return 2
    if study is None:
        print(f"study {args.study_id} deleted")
    else:
        print(f"study {study['id']} {study['name']}: {study['state']} n_trials={study['n_trials']} {study['trial_counts']}")
    return 0


class DatabaseTenants:
    """``fusetune tenants ... --database``: the tenants service on the database, as its operator.

    For bootstrapping (no admin token yet) and for an operator who holds the database
    credentials; takes the same calls as :class:`fusetune.client.Client`.
    """

    def __init__(self, url: str) -> None:
        from fusetune.server.db import get_optuna_storage, get_sessionmaker, upgrade

        upgrade(url)
        get_optuna_storage(url)  # the server creates Optuna's tables beside ours too
        self.sessions = get_sessionmaker(url)

    def _run(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        with self.sessions() as session:
            out = call(session, *args, **kwargs)
        return [o.model_dump(mode="json") for o in out] if isinstance(out, list) else out.model_dump(mode="json")

    def _all(self, call: Any, *args: Any) -> list[dict[str, Any]]:
        """Every page of a listing, as the REST client follows its Link headers."""
        from fusetune.server.pagination import MAX_LIMIT, PageParams

        rows: list[dict[str, Any]] = []
        after = None
        with self.sessions() as session:
            while True:
                page = call(session, *args, page=PageParams(limit=MAX_LIMIT, after=after))
                rows += [o.model_dump(mode="json") for o in page.items]
                if page.next is None:
                    return rows
                after = page.next

    def tenants(self) -> list[dict[str, Any]]:
        from fusetune.server import tenants

        return self._all(tenants.list_tenants)

    def create_tenant(self, name: str, weight: float = 1.0, **fields: Any) -> dict[str, Any]:
        from fusetune.server import tenants
        from fusetune.server.schemas import TenantCreate

        return self._run(tenants.create_tenant, TenantCreate(name=name, weight=weight, **fields))

    def update_tenant(self, name: str, **fields: Any) -> dict[str, Any]:
        from fusetune.server import tenants
        from fusetune.server.schemas import TenantUpdate

        return self._run(tenants.update_tenant, name, TenantUpdate(**fields))

    def set_weight(self, name: str, weight: float) -> dict[str, Any]:
        return self.update_tenant(name, weight=weight)

    def tokens(self, tenant: str) -> list[dict[str, Any]]:
        from fusetune.server import tenants

        return self._all(tenants.list_tokens, tenant)

    def create_token(self, tenant: str, label: str | None = None) -> dict[str, Any]:
        from fusetune.server import tenants

        return self._run(tenants.create_token, tenant, label)

    def revoke_token(self, token_id: int) -> dict[str, Any]:
        from fusetune.server import tenants

        return self._run(tenants.revoke_token, token_id)

    def close(self) -> None:
        pass


def _quota(value: str) -> int | None:
    """A quota on the command line: a count, or ``none`` for no limit."""
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a count or 'none', not {value!r}") from None


def cmd_tenants(args: argparse.Namespace) -> int:
    from fusetune.server.errors import Conflict, Invalid, NotFound

    if args.database or args.database_url:
        backend: Any = DatabaseTenants(args.database_url or get_settings().database_url)
    else:
        backend = Client(args.url, token=args.token)
    try:
        if args.action == "create":
            quotas = {k: getattr(args, k) for k in ("max_running_studies", "max_trials_per_study") if getattr(args, k) is not None}
            created = backend.create_tenant(args.name, args.weight, token_label=args.label, **quotas)
            print(json.dumps(created, indent=2))
            print(f"tenant {args.name}'s token is shown only this once: hand it over as FUSETUNE_TOKEN", file=sys.stderr)
        elif args.action == "list":
            print(f"{'tenant':<24} {'weight':>8} {'max running studies':>20} {'max trials/study':>17} {'code upload':>12}")
            for t in backend.tenants():
                limits = [("-" if t[k] is None else t[k]) for k in ("max_running_studies", "max_trials_per_study")]
                upload = "on" if t.get("code_upload") else "off"
                print(f"{t['name']:<24} {t['weight']:>8g} {limits[0]:>20} {limits[1]:>17} {upload:>12}")
        elif args.action == "set-weight":
            print(json.dumps(backend.set_weight(args.name, args.weight), indent=2))
        elif args.action == "set-code-upload":
            print(json.dumps(backend.update_tenant(args.name, code_upload=args.allowed == "on"), indent=2))
        elif args.action == "set-quota":
            changes = {k: getattr(args, k) for k in ("max_running_studies", "max_trials_per_study") if hasattr(args, k)}
            print(json.dumps(backend.update_tenant(args.name, **changes), indent=2))
        elif args.action == "token":
            print(json.dumps(backend.create_token(args.name, args.label), indent=2))
            print("the token is shown only this once", file=sys.stderr)
        elif args.action == "tokens":
            print(f"{'id':>5} {'created':<26} {'revoked':<26} label")
            for t in backend.tokens(args.name):
                print(f"{t['id']:>5} {t['created_at']:<26} {t['revoked_at'] or '-':<26} {t['label'] or ''}")
        elif args.action == "revoke":
            revoked = backend.revoke_token(args.token_id)
            print(f"token {revoked['id']} of tenant {revoked['tenant']} revoked at {revoked['revoked_at']}")
    except FusetuneError as exc:
        print(f"rejected: {exc}", file=sys.stderr)
        return 2
    except (ValidationError, NotFound, Conflict, Invalid) as exc:
        print(f"rejected: {exc}", file=sys.stderr)
        return 2
    finally:
        backend.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import ray

    from fusetune.server.auth import new_token

    settings = get_settings()
    made_up_admin = settings.admin_token is None
    if made_up_admin:  # this run's admin, to create the local tenant's token with
        settings = settings.model_copy(update={"admin_token": SecretStr(new_token())})
    print(f"fusetune: database {settings.database_url}; starting the service and a local Ray instance ...")
    # Ray installs its signal handlers only from the main thread, not from uvicorn's.
    ray.init(address=settings.ray_address, include_dashboard=False, log_to_driver=False)
    # Stopped by SIGTERM (kill, a container's stop) as by Ctrl-C: the server and its loop stop
    # below, where Ray's handler, which ray.init just installed, would end the process as it stands.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server: BackgroundServer | None = None
    assert settings.admin_token is not None  # made up above when the environment set none
    try:
        server = BackgroundServer(settings).start()
        with Client(server.url, token=settings.admin_token.get_secret_value()) as admin:
            token = _local_tenant_token(admin)
        print(f"tenant 'default', its token (shown once; also in the summary below):\n  export FUSETUNE_URL={server.url} FUSETUNE_TOKEN={token}")
        print(f"dashboard (logs in as 'default'; watch the sweep live):\n  {server.url}/#token={token}")
        if made_up_admin:
            print(f"admin token of this run (set FUSETUNE_ADMIN_TOKEN to keep one):\n  {settings.admin_token.get_secret_value()}")
        with Client(server.url, token=token) as client:
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
            print(f"\ndashboard: {server.url}/#token={token}")
            print(f"\nAPI docs:  {server.url}/docs")
            print(f"trials:    {server.url}/api/v1/studies/{study['id']}/trials")
            print(f"token:     export FUSETUNE_URL={server.url} FUSETUNE_TOKEN={token}   (tenant 'default')")
            print(f'try:       curl -H "Authorization: Bearer $FUSETUNE_TOKEN" {server.url}/api/v1/studies/{study["id"]}')
            print(f"Optuna:    optuna.load_study(study_name={study['name']!r}, storage={settings.database_url!r})")
        if args.exit:
            return 0
        print("\nserving until interrupted (Ctrl-C) ...", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        if server is not None:
            server.stop()


def _local_tenant_token(admin: Client) -> str:
    """A new token for the local tenant ``default``, creating the tenant if needed. The demo's
    tenant may upload its own code (``code_upload``): the machine is its user's."""
    if "default" not in {t["name"] for t in admin.tenants()}:
        token = admin.create_tenant("default", token_label="fusetune demo", code_upload=True)["token"]["token"]
    else:
        admin.set_code_upload("default", True)
        token = admin.create_token("default", label="fusetune demo")["token"]
    return str(token)


def main(argv: list[str] | None = None) -> int:
    out, err = sys.stdout, sys.stderr
    # A tenant's text reaches this terminal: as text, never as the terminal's commands.
    sys.stdout, sys.stderr = Inert(out), Inert(err)
    try:
        return _main(argv)
    finally:
        sys.stdout, sys.stderr = out, err


def _main(argv: list[str] | None) -> int:
    logging.basicConfig(level=get_settings().log_level, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="fusetune", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    default_url = f"http://{get_settings().host}:{get_settings().port}"

    p = sub.add_parser("serve", help="run the service (API + scheduling loop)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.set_defaults(func=cmd_serve)

    rest = argparse.ArgumentParser(add_help=False)
    # FUSETUNE_URL first, as the Python client reads it; else this machine's own service.
    rest.add_argument(
        "--url", default=os.environ.get("FUSETUNE_URL") or default_url,
        help=f"the service (default: FUSETUNE_URL, else {default_url})",
    )
    rest.add_argument("--token", help="bearer token (default: FUSETUNE_TOKEN)")

    p = sub.add_parser(
        "submit", parents=[rest], help="submit a study from a JSON file ('-' for stdin)",
        description="Submit a study: the JSON body of POST /api/v1/studies, from a file ('-' for stdin). With --code, "
        "the body's workload is the user's own, a 'module:attr' path inside DIR: the folder is packaged "
        "(fusetune.client.package; the body's search_space, when it has one, is the package's, else the workload's "
        "own space, which must be static), uploaded once, and the study runs it. Uploading code takes the "
        "admin's code_upload grant (`fusetune tenants set-code-upload NAME on`).",
    )
    p.add_argument("file", help="the study as JSON ('-': stdin)")
    p.add_argument("--code", metavar="DIR", help="a folder of the user's own code; the body's workload is a module:attr path in it")
    p.add_argument(
        "--requirement", action="append", default=[], metavar="REQ",
        help="a pip requirement the workers install for the code (repeatable; with --code)",
    )
    p.add_argument(
        "--exclude", action="append", default=[], metavar="PATTERN",
        help="a gitignore pattern of files left out of --code besides .git, __pycache__, *.pyc, .venv and "
        "node_modules (repeatable)",
    )
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", parents=[rest], help="list studies, or one study's trials")
    p.add_argument("study_id", nargs="?", type=int)
    p.set_defaults(func=cmd_status)

    for command, text in (
        ("pause", "pause a study: nothing new starts; running trials leave at the next epoch boundary and wait"),
        ("resume", "run a paused study again"),
        ("cancel", "cancel a study: its unfinished trials end (PRUNED or FAIL) with the reason"),
        ("delete", "delete a study, its Optuna study and its artifacts (a running one is cancelled first)"),
    ):
        p = sub.add_parser(command, parents=[rest], help=text)
        p.add_argument("study_id", type=int)
        p.set_defaults(func=cmd_lifecycle)
    p = sub.add_parser("extend", parents=[rest], help="set a study's n_trials (more trials; a COMPLETE study runs again)")
    p.add_argument("study_id", type=int)
    p.add_argument("n_trials", type=int)
    p.set_defaults(func=cmd_lifecycle)

    _tenant_commands(sub, rest)

    p = sub.add_parser("demo", help="start the service, run the demo sweep, keep serving")
    p.add_argument("--exit", action="store_true", help="exit when the sweep is done instead of serving")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=cmd_demo)

    sub.add_parser(
        "simulate",
        help="replay a cluster trace under every scheduling policy (fusetune.server.simulate)",
        add_help=False,
    )

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:
        from fusetune.server import simulate

        return simulate.main(argv[1:])
    return _run(parser.parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    """Run the chosen command; the slips a user makes end it with one line on stderr."""
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except (httpx.TransportError, httpx.InvalidURL) as exc:
        # A user's slip (no service there, a URL without its scheme): one line, not a traceback
        # (FUSETUNE_LOG_LEVEL=DEBUG shows it).
        log.debug("the service could not be reached", exc_info=True)
        print(f"cannot reach the service at {getattr(args, 'url', '?')!r}: {exc}", file=sys.stderr)
        return 2
    except OperationalError as exc:
        log.debug("the database could not be used", exc_info=True)
        print(f"cannot use the database: {exc.orig}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`fusetune status 5 | head`): stop quietly, as other Unix
        # tools do, and point stdout at /dev/null so that the interpreter's own flush at
        # exit does not raise again (the recipe of Python's signal documentation).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # a file named on the command line that is not there, or not readable
        log.debug("a file could not be used", exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _tenant_commands(sub: Any, rest: argparse.ArgumentParser) -> None:
    """``fusetune tenants ...``: over the API, or on the database as its operator."""
    tenants = sub.add_parser(
        "tenants",
        help="create and list tenants, set weights and quotas, issue and revoke tokens",
        description="Over the REST API with the admin's token (--token or FUSETUNE_TOKEN; a tenant's "
        "own token may list, issue and revoke its tokens), or with --database directly on the "
        "database, as its operator (e.g. to create the first tenants when no FUSETUNE_ADMIN_TOKEN is set).",
    )
    tenants.set_defaults(func=cmd_tenants)
    via = argparse.ArgumentParser(add_help=False, parents=[rest])
    via.add_argument("--database", action="store_true", help="work on the database (FUSETUNE_DATABASE_URL), not the API")
    via.add_argument("--database-url", metavar="URL", help="work on the database at URL (implies --database)")
    actions = tenants.add_subparsers(dest="action", required=True)
    p = actions.add_parser("create", parents=[via], help="create a tenant; prints its first token, once")
    p.add_argument("name")
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--max-running-studies", type=int)
    p.add_argument("--max-trials-per-study", type=int)
    p.add_argument("--label", help="a note on the token (who holds it)")
    actions.add_parser("list", parents=[via], help="tenants, weights and quotas")
    p = actions.add_parser("set-weight", parents=[via], help="change a tenant's weight")
    p.add_argument("name")
    p.add_argument("weight", type=float)
    p = actions.add_parser(
        "set-code-upload", parents=[via], help="grant ('on') or withdraw ('off') a tenant's code_upload: uploading and running its own code"
    )
    p.add_argument("name")
    p.add_argument("allowed", choices=("on", "off"))
    p = actions.add_parser("set-quota", parents=[via], help="change a tenant's quotas ('none': no limit)")
    p.add_argument("name")
    # A quota not named stays as it is (SUPPRESS: argparse leaves it out of args, where a
    # string default would be run through _quota).
    p.add_argument("--max-running-studies", type=_quota, default=argparse.SUPPRESS, metavar="N|none")
    p.add_argument("--max-trials-per-study", type=_quota, default=argparse.SUPPRESS, metavar="N|none")
    p = actions.add_parser("token", parents=[via], help="issue another token for a tenant; printed once")
    p.add_argument("name")
    p.add_argument("--label", help="a note on the token (who holds it)")
    p = actions.add_parser("tokens", parents=[via], help="a tenant's tokens (ids, dates; never the tokens)")
    p.add_argument("name")
    p = actions.add_parser("revoke", parents=[via], help="revoke a token by its id")
    p.add_argument("token_id", type=int)


if __name__ == "__main__":
    sys.exit(main())
