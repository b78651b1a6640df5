"""``attnzoo push`` / ``attnzoo pull``: ``dvc push``/``dvc pull`` with one clear sentence on failure.

DVC reports a remote that refuses (a path that is not a folder, no permission, a missing bucket,
bad credentials) as ``ERROR: unexpected error - [Errno 20] ...`` without saying what to do. These
wrap the same commands (DVC's own progress output is shown as it comes) and, when DVC fails, end
with ``error: ...`` naming the remote, its URL, DVC's reason and the fix; exit code 2. A failed
push never touches the local cache (DVC only reads it), so nothing is lost locally.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from pipeline.config import UserError
from pipeline.entry import run_cli


def remote_url(name: str | None) -> tuple[str, str]:
    """(remote name, URL) of ``name`` or of the default remote; UserError when there is none.

    Read from DVC's merged configuration (``dvc remote list`` wraps long lines to the terminal)."""
    from dvc.repo import Repo

    try:
        config = Repo(".").config
    except Exception as err:  # noqa: BLE001 - not a DVC repository, unreadable config
        raise UserError(f"no DVC repository here ({err}): run attnzoo from the repository root") from None
    remotes = {k: v.get("url", "") for k, v in config.get("remote", {}).items()}
    if name is None:
        name = config.get("core", {}).get("remote")
        if not name:
            raise UserError("no default DVC remote: add one with `dvc remote add -d NAME URL` (docs/cluster.md), "
                            "or name one with -r")
    if name not in remotes:
        raise UserError(f"no DVC remote named '{name}' (known: {sorted(remotes) or 'none'}): "
                        "add it with `dvc remote add NAME URL`")
    return name, remotes[name]


def reason(output: str) -> str:
    """DVC's last ERROR line without its prefixes ("unexpected error - [Errno 20] ...")."""
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    text = errors[-1][len("ERROR:"):].strip() if errors else (output.strip().splitlines() or ["unknown error"])[-1]
    return text.removeprefix("unexpected error - ").strip()


def transfer(command: str, remote: str | None, targets: list[str]) -> None:
    name, url = remote_url(remote)
    # DVC's output is passed on as it comes (its ERROR lines, which may go to either stream, are
    # kept for the one sentence below). DVC of this interpreter: `.venv/bin/attnzoo` run without the
    # venv activated has no `dvc` on PATH.
    proc = subprocess.Popen([sys.executable, "-m", "dvc", command, "-r", name, *targets], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    errors = []
    for line in proc.stdout:
        if line.startswith("ERROR:"):
            errors.append(line)
        else:
            sys.stderr.write(line)
    if proc.wait() != 0:
        where = "to" if command == "push" else "from"
        fix = ("check that it exists and this machine may write there, or point the remote elsewhere with "
               f"`dvc remote modify {name} url NEW_URL`, then run `attnzoo {command}` again; the local cache is "
               "untouched" if command == "push" else
               f"check that it exists and this machine may read it (`dvc remote modify {name} url ...`), then "
               f"run `attnzoo {command}` again")
        raise UserError(f"DVC could not {command} {where} remote '{name}' at {url} ({reason(''.join(errors))}): {fix}")


def main(argv: list[str] | None = None, command: str = "push") -> None:

    ap = argparse.ArgumentParser(prog=f"attnzoo {command}",
                                 description=f"dvc {command} with one clear sentence when the remote refuses.")
    ap.add_argument("-r", "--remote", default=None, help="a DVC remote's name (default: the default remote)")
    ap.add_argument("targets", nargs="*", help="stages or outputs (default: everything dvc.lock records)")
    args = ap.parse_args(argv)
    run_cli(lambda: transfer(command, args.remote, args.targets))


def pull(argv: list[str] | None = None) -> None:
    main(argv, "pull")
