"""A stand-in ``scontrol`` and ``sinfo`` for one Slurm node: try remediation without a cluster.

``install(folder, node)`` writes both into ``folder`` with the node's state beside them
(``state.json``: state, reason, when the reason was set) and a log of every call
(``calls.log``). They find those files next to themselves: the daemon runs Slurm's tools
with a fixed PATH and C locale only (daemon.slurmctl), no variable of ours.

What they answer, as Slurm 22.05 does for the calls gpudiag makes:
- ``scontrol show node NAME``: the node (``Gres=gpu:8``, ``State=``, ``Partitions=debug``,
  ``Reason=... [root@TIME]``); an unknown NAME exits 1 with Slurm's "Node NAME not found".
- ``scontrol update NodeName=NAME State=DRAIN Reason=...`` (either case) drains it;
  ``State=RESUME`` resumes it. ``scontrol ping``: "Slurmctld(primary) at NAME is UP".
- ``sinfo --noheader --Node --format=%N|%H|%E``: ``NAME|TIME|REASON`` (``none`` when none).
- A file named ``down`` beside them: every call fails the way a scontrol that cannot reach
  slurmctld does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STANDIN = r'''
import json, os, signal, sys, time
# `scontrol show node | grep -q` closes the pipe early: end quietly, as scontrol does.
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
here = os.path.dirname(os.path.realpath(__file__))
state_path = os.path.join(here, "state.json")
tool = os.path.basename(sys.argv[0])
args = sys.argv[1:]
with open(os.path.join(here, "calls.log"), "a") as fh:
    fh.write(json.dumps([tool, *args]) + "\n")
if os.path.exists(os.path.join(here, "down")):
    print("slurm_load_node error: Unable to contact slurm controller (connect failure)",
          file=sys.stderr)
    sys.exit(1)
with open(state_path) as fh:
    st = json.load(fh)
node = st["node"]
stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(st.get("reason_set") or time.time()))
if tool == "sinfo":
    print(f"{node}|{stamp if st['reason'] else 'Unknown'}|{st['reason'] or 'none'}")
elif args[:1] == ["ping"]:
    print(f"Slurmctld(primary) at {node} is UP")
elif args[:2] == ["show", "node"]:
    if len(args) < 3 or args[2] != node:
        print(f"Node {args[2] if len(args) > 2 else ''} not found", file=sys.stderr)
        sys.exit(1)
    print(f"NodeName={node} Arch=x86_64 CoresPerSocket=1\n   Gres=gpu:8\n"
          f"   State={st['state']} ThreadsPerCore=1\n   Partitions=debug\n"
          + (f"   Reason={st['reason']} [root@{stamp}]\n" if st["reason"] else ""))
elif args[:1] == ["update"]:
    fields = {k.lower(): v for k, v in (a.split("=", 1) for a in args[1:] if "=" in a)}
    if fields.get("nodename") != node:
        print(f"Invalid node name specified: {fields.get('nodename')}", file=sys.stderr)
        sys.exit(1)
    if fields.get("state", "").lower() == "drain":
        st.update(state="IDLE+DRAIN", reason=fields.get("reason", ""), reason_set=time.time())
    elif fields.get("state", "").lower() == "resume":
        st.update(state="IDLE", reason="", reason_set=None)
    with open(state_path, "w") as fh:
        json.dump(st, fh)
else:
    print(f"{tool} stand-in: unsupported {args}", file=sys.stderr)
    sys.exit(1)
'''


def install(folder: Path, node: str) -> tuple[Path, Path]:
    """Write the stand-in scontrol and sinfo into ``folder`` for an idle ``node``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for tool in ("scontrol", "sinfo"):
        path = folder / tool
        path.write_text(f"#!{sys.executable}\n{STANDIN}")
        path.chmod(0o755)  # not group-writable: the daemon refuses to run such a file
        paths.append(path)
    state = folder / "state.json"
    if not state.exists():
        state.write_text(json.dumps({"node": node, "state": "IDLE", "reason": "",
                                     "reason_set": None}))
    return paths[0], paths[1]
