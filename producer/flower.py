"""`renderfarm flower`: Flower, the operators' dashboard, on the farm's broker, behind basic auth.

Flower runs in this process through Celery's own command line: ``app.start(["flower", ...])``
is what ``celery -A APP flower ...`` does, with ``APP`` the app :func:`renderfarm.queue.make_app`
builds. So Flower sees exactly what producers and workers see: the same broker, result
backend, Redis transport options (priority queues, visibility timeout) and JSON serializers.

Credentials come from the environment, never from the command line (a command line is
readable by every user of the host through ``ps``):

    RENDERFARM_FLOWER_AUTH="user:password[,user2:password2]"   -> Flower's --basic_auth

Without it the command refuses to start, unless ``--no-auth`` is given; it also refuses a
well-known password (``change-me``, ``admin``, ...) or one equal to its user name, the first
things anyone tries. Whatever the auth,
Flower serves ``/metrics`` (Prometheus) and ``/healthcheck`` WITHOUT authentication: that is
Flower's design, not ours. Keep the port off the public internet.

Every job is one task named ``renderfarm.render`` whose keyword arguments are the job spec,
so Flower's task list shows each job's prompt, seed and campaign, and its search box finds a
campaign's jobs with ``kwargs:campaign=NAME``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

ENV_AUTH = "RENDERFARM_FLOWER_AUTH"
DEFAULT_PORT = 5555
DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_MAX_TASKS = 100_000  # Flower's own default
# Options the wrapper owns: given after `--` they would bypass the checks above.
# Celery's command line, which runs Flower here, reads these generic names from the environment
# (click envvars without a prefix): APP would replace the farm's app, BROKER_URL and
# RESULT_BACKEND its broker and backend. They are not the farm's settings: ignore them.
CELERY_CLI_ENV = ("APP", "BROKER_URL", "RESULT_BACKEND", "LOADER", "CONFIG_MODULE")
# Passwords tried first by anyone who finds the port (compared lower-cased, letters and digits
# only, so Change_Me and change-me count too); a password equal to its user name is refused too.
WELL_KNOWN_PASSWORDS = frozenset({
    "changeme", "admin", "password", "flower", "secret", "123456", "12345678", "123456789",
    "qwerty", "letmein", "passw0rd", "password1", "default", "guest", "root", "admin123"})
OWNED_OPTIONS = {"basic_auth": f"set {ENV_AUTH} instead", "port": "use --port", "address": "use --address",
                 "max_tasks": "use --max-tasks", "broker": "use --broker"}

DESCRIPTION = f"""\
Run Flower (the Celery dashboard) against the farm's broker: workers, queues, every job
(task renderfarm.render, its keyword arguments are the job spec) and failures.

Basic auth comes from the environment: {ENV_AUTH}="user:password[,user2:password2]"
(no commas or leading/trailing spaces in passwords). Without it the command refuses to
start, unless --no-auth is given. Well-known passwords (change-me, admin, password, ...)
and a password equal to its user name are refused.

NOT behind auth, whatever you set: /metrics (Prometheus: worker names, task counts and
runtimes) and /healthcheck. Flower serves them to anyone who can reach the port, so keep
the port on a private network or behind a proxy.
"""

EPILOG = """\
Any other Flower option goes after `--`, as --name=value, e.g.
  renderfarm flower --address 0.0.0.0 -- --persistent=True --db=/var/lib/flower/state
Flower also reads FLOWER_<OPTION> environment variables (FLOWER_PERSISTENT=true, ...).
"""


class FlowerConfigError(Exception):
    """A setting `renderfarm flower` cannot start with; the message says which and why."""


def parse_auth(value: str) -> list[str]:
    """``"u:p,u2:p2"`` -> ``["u:p", "u2:p2"]``; errors name the variable and the entry or its
    user, never a password (not even by saying it equals the user name)."""
    credentials = []
    for number, entry in enumerate(value.split(","), start=1):
        entry = entry.strip()
        user, colon, password = entry.partition(":")
        if not entry:
            raise FlowerConfigError(f"{ENV_AUTH}: entry {number} is empty "
                                    "(expected user:password[,user2:password2])")
        if not colon or not user or not password:
            raise FlowerConfigError(f"{ENV_AUTH}: entry {number} is not user:password with a non-empty "
                                    "user and password (expected user:password[,user2:password2])")
        if guessable(user, password):
            raise FlowerConfigError(f"{ENV_AUTH}: user {user!r} has a well-known or guessable password; "
                                    "Flower shows every job and can stop the workers: choose a long "
                                    "random one (e.g. openssl rand -hex 16)")
        credentials.append(entry)
    return credentials


def guessable(user: str, password: str) -> bool:
    """A password from WELL_KNOWN_PASSWORDS, or the user name again (case aside)."""
    plain = re.sub(r"[^a-z0-9]", "", password.lower())
    return plain in WELL_KNOWN_PASSWORDS or password.lower() == user.lower()


def check_flower_options(extra: Sequence[str]) -> list[str]:
    """Flower silently ignores options it does not know: refuse them here instead."""
    from flower.options import default_options

    checked = []
    for arg in extra:
        name, equals, _ = arg.partition("=")
        if not name.startswith("--") or not equals:
            raise FlowerConfigError(f"Flower options after `--` must read --name=value, got {arg!r}")
        key = name[2:].replace("-", "_")
        if key in OWNED_OPTIONS:
            raise FlowerConfigError(f"{name} after `--`: {OWNED_OPTIONS[key]}")
        if key not in default_options:
            raise FlowerConfigError(f"{name}: not a Flower {_flower_version()} option")
        checked.append(arg)
    return checked


def flower_argv(args: argparse.Namespace, credentials: Sequence[str]) -> list[str]:
    """The `celery ... flower` arguments for these command-line arguments and credentials."""
    argv = ["flower", f"--port={args.port}", f"--address={args.address}", f"--max_tasks={args.max_tasks}"]
    if credentials:
        argv.append("--basic_auth=" + ",".join(credentials))
    return argv + check_flower_options(args.flower_args)


def _flower_version() -> str:
    from importlib.metadata import version

    return version("flower")


def _error(message: str) -> int:
    print(f"renderfarm flower: error: {message}", file=sys.stderr)
    return 2


def cmd_flower(args: argparse.Namespace) -> int:
    raw = os.environ.get(ENV_AUTH, "").strip()
    credentials: list[str] = []
    try:
        if raw:
            credentials = parse_auth(raw)
        argv = flower_argv(args, credentials)
    except FlowerConfigError as err:
        return _error(str(err))
    if raw and args.no_auth:
        print(f"renderfarm flower: --no-auth ignored: {ENV_AUTH} is set, so basic auth is on "
              "(unset it to run without auth)", file=sys.stderr)
    elif not raw and not args.no_auth:
        return _error(
            f"{ENV_AUTH} is not set. Flower shows every job's prompt and can shut workers down, so it "
            f"runs behind HTTP basic auth: export {ENV_AUTH}='user:password[,user2:password2]'. "
            "To run it open anyway (e.g. behind your own authenticating proxy), pass --no-auth.")
    elif not raw:
        print(f"renderfarm flower: WARNING: no authentication (--no-auth): anyone who can reach "
              f"{args.address}:{args.port} sees every job and can control the workers. Flower's "
              "HTTP API (/api/...) answers 401 unless FLOWER_UNAUTHENTICATED_API=true.", file=sys.stderr)

    ignored = [name for name in CELERY_CLI_ENV if os.environ.pop(name, None) is not None]
    if ignored:
        print(f"renderfarm flower: ignoring {', '.join(ignored)} from the environment (Celery's command "
              "line would read them); the broker is --broker or RENDERFARM_BROKER_URL", file=sys.stderr)

    from renderfarm.queue import make_app
    from renderfarm.settings import Settings

    app = make_app(Settings.from_env(broker_url=args.broker))
    code = app.start(argv)  # blocks until SIGTERM / SIGINT
    return int(code or 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    parser.add_argument("--address", default=DEFAULT_ADDRESS,
                        help=f"address to listen on (default {DEFAULT_ADDRESS}; 0.0.0.0 for all interfaces)")
    parser.add_argument("--broker", help="broker URL (default: $RENDERFARM_BROKER_URL or redis://localhost:6379/0)")
    parser.add_argument("--no-auth", action="store_true",
                        help=f"start even though {ENV_AUTH} is unset: no authentication at all")
    parser.add_argument("--max-tasks", type=int, default=DEFAULT_MAX_TASKS,
                        help="jobs Flower keeps in memory, oldest dropped first (default %(default)s); "
                             "raise it for big campaigns, memory grows with it")
    parser.add_argument("flower_args", nargs="*", metavar="-- --FLOWER-OPTION=VALUE",
                        help="further Flower options, after `--`")
    parser.set_defaults(handler=cmd_flower)


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `flower` to the `renderfarm` command's subcommands."""
    parser = sub.add_parser("flower", help="run Flower, the dashboard, behind basic auth",
                            description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser
