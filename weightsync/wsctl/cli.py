"""wsctl: the operator's admin client for a trainer-svc.

Exit codes: 0 success; 1 the operation ran but failed (e.g. a rollout did not commit);
2 bad usage; 3 the trainer could not be reached or refused the call (auth, busy).
`wsctl sync` shows the sync's phases and bytes on stderr while it runs (not in --json mode).
Imports neither torch nor megatron, so it starts fast anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from weightsync import __version__
from weightsync.bus.transports import NAMES as TRANSPORTS
from weightsync.config import ConfigError
from weightsync.control.auth import check_token_file_mode
from weightsync.control.client import channel, describe_rpc_error, trainer_stub
from weightsync.v1 import rollout_pb2, trainer_pb2

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3

# `load` and `export` act on the trainer's filesystem, which may be another host's: a path is sent
# as written, so a relative one cannot mean this shell's working directory.
PATHS_HELP = (
    "paths (load, export): a directory on the trainer's host, absolute or relative to the trainer's\n"
    "--data-root (which defaults to the trainer's working directory), never to this shell's;\n"
    "it must lie under the data root or the trainer's checkpoint_dir. The reply names the\n"
    "absolute path the trainer used."
)


def _state_name(num: int) -> str:
    return rollout_pb2.EngineState.Name(num) if num in rollout_pb2.EngineState.values() else str(num)


def _as_dict(msg) -> dict:
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*["-" * w for w in widths])] + [fmt.format(*r) for r in rows])


def _skew(st: trainer_pb2.TrainerStatus, r: trainer_pb2.RolloutInfo) -> str:
    if r.origin != st.origin:
        return "never synced" if not r.origin else "other trainer run"
    return "current" if r.version == st.version else f"behind by {st.version - r.version}"


def print_status(st: trainer_pb2.TrainerStatus) -> None:
    print(
        f"trainer  version {st.version}  family {st.model_family}  params {st.num_parameters:,}  "
        f"backend {st.backend} ({st.parallelism}){'  SYNC IN PROGRESS' if st.sync_in_progress else ''}"
    )
    rows = [
        [
            r.rollout_id,
            r.address,
            str(r.version),
            _state_name(r.state),
            "yes" if r.reachable else "NO",
            _skew(st, r),
            r.last_error[:60],
        ]
        for r in st.rollouts
    ]
    print(
        _table(rows, ["ROLLOUT", "ADDRESS", "VERSION", "STATE", "REACHABLE", "SKEW", "LAST ERROR"])
        if rows
        else "no rollouts registered"
    )
    if st.last_sync.sync_id:
        print_report(st.last_sync, prefix="last sync")


def print_report(rep: trainer_pb2.SyncReport, prefix: str = "sync") -> None:
    ok = sum(r.ok for r in rep.rollouts)
    print(
        f"{prefix} {rep.sync_id}: version {rep.version}, {ok}/{len(rep.rollouts)} committed, {rep.seconds:.3f}s, "
        f"{rep.bytes / 1e6:.1f} MB in {rep.num_buckets} buckets ({rep.num_tensors} tensors), "
        f"{rep.gbps:.3f} GB/s over {rep.transport}"
        + (f"; {rep.wire_bytes / 1e6:.1f} MB on the bus" if rep.wire_bytes else "")
    )
    if rep.route:
        print(f"  route: {rep.route}")
    if rep.phase_seconds:
        order = ["plan", "prepare", "stream", "commit"]
        names = sorted(rep.phase_seconds, key=lambda n: (order.index(n) if n in order else len(order), n))
        print("  phases: " + ", ".join(f"{n} {rep.phase_seconds[n] * 1e3:.1f} ms" for n in names))
    if rep.senders:
        # the per-sender split: one slow or overloaded rank shows as the longest stream
        slowest = max(s.seconds for s in rep.senders)
        print(f"  senders ({len(rep.senders)}):")
        for s in rep.senders:
            mark = "  <- slowest" if len(rep.senders) > 1 and s.seconds == slowest else ""
            fwd = f", {s.forwarded_bytes / 1e6:.1f} MB forwarded to it" if s.forwarded_bytes else ""
            err = f"  FAILED: {s.error}" if s.error else ""
            buf = f", buffers {s.peak_buffer_bytes / 1e6:.1f} MB" if s.peak_buffer_bytes else ""
            # sent from the parameters' own storage: no export pass, no pack (MegatronActor.own_flat_buckets)
            flat = f", {s.flat_buckets} sent in place" if s.flat_buckets else ""
            print(
                f"    rank {s.rank}: {s.bytes / 1e6:.1f} MB in {s.num_buckets} buckets{flat}, {s.seconds:.3f}s"
                f"{buf}{fwd}{mark}{err}"
            )
    for r in rep.rollouts:
        how = f" ({r.encoding}, {r.wire_bytes / 1e6:.1f} MB)" if r.encoding else ""
        print(f"  {r.rollout_id}: {'committed v' + str(r.version) if r.ok else 'FAILED: ' + r.error}{how}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wsctl",
        description="weightsync admin client",
        epilog=PATHS_HELP + "\n\nexit codes: 0 ok, 1 operation failed, 2 usage, 3 trainer unreachable/refused",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--address",
        default=os.environ.get("WSCTL_ADDRESS", "127.0.0.1:50051"),
        help="trainer gRPC address (env WSCTL_ADDRESS)",
    )
    p.add_argument(
        "--token-file",
        default=os.environ.get("WSCTL_TOKEN_FILE", ""),
        help="file with the control-plane token (env WSCTL_TOKEN_FILE; or WSCTL_TOKEN)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="RPC deadline in seconds")
    p.add_argument(
        "--json",
        action="store_true",
        help="machine-readable output, errors included (also accepted after the subcommand)",
    )
    p.add_argument("--version", action="version", version=f"wsctl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    # `--json` on either side of the subcommand; SUPPRESS keeps a subcommand without it from
    # resetting what was given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    sub.add_parser("status", parents=[common], help="trainer version, rollouts, their versions and states, last sync")
    s = sub.add_parser(
        "sync", parents=[common], help="publish the trainer's weights to rollouts and wait for the result"
    )
    s.add_argument("--rollout", action="append", default=[], help="rollout id (repeatable; default: all)")
    s.add_argument("--transport", choices=TRANSPORTS, default="", help="override the default transport")
    s.add_argument("--sync-timeout", type=float, default=0.0, help="per-sync timeout in seconds (0 = trainer default)")
    s.add_argument(
        "--allow-rollback",
        action="store_true",
        help="let rollouts go back to a lower version of this trainer (refused otherwise; logged and "
        "counted in weightsync_sync_rollbacks_total)",
    )
    s.add_argument(
        "--senders",
        choices=["all", "rank0"],
        default="",
        help="override who streams: every rank that owns tensors (all) or global rank 0 alone",
    )
    lw = sub.add_parser(
        "load",
        parents=[common],
        epilog=PATHS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="load an HF safetensors directory into the trainer (bumps its version)",
    )
    lw.add_argument("path", help="on the trainer's host: absolute, or relative to its --data-root")
    ex = sub.add_parser(
        "export",
        parents=[common],
        epilog=PATHS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="write the trainer's exported HF tensors to a directory on the trainer host",
    )
    ex.add_argument("out_dir", help="on the trainer's host: absolute, or relative to its --data-root")
    co = sub.add_parser("completion", help="print a shell completion script: source <(wsctl completion bash)")
    co.add_argument("shell", choices=["bash", "zsh"])
    return p


def _fail(ns, exit_code: int, message: str, code: str = "") -> int:
    """An error on stderr, or in --json mode as one JSON object on stdout (what a script parses)."""
    if getattr(ns, "json", False):
        print(
            json.dumps(
                {
                    "error": {
                        "command": ns.command,
                        "address": ns.address,
                        "code": code,
                        "message": message,
                        "exit_code": exit_code,
                    }
                }
            )
        )
    else:
        print(f"wsctl: {message}", file=sys.stderr)
    return exit_code


NOTHING_TO_SYNC = (
    "nothing to sync: no rollout is registered with this trainer (a rollout registers itself when "
    "started with --trainer-address pointing here; `wsctl status` lists them)"
)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # `wsctl status | head`: the reader left after the command did its work. Point stdout at
        # /dev/null so the interpreter's final flush does not raise (and print a traceback) again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OK


def _main(argv: list[str] | None) -> int:
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    if ns.command == "completion":
        from weightsync.wsctl.completion import script

        print(script(build_parser(), ns.shell), end="")
        return EXIT_OK
    token = os.environ.get("WSCTL_TOKEN", "")
    if ns.token_file:
        try:
            check_token_file_mode(Path(ns.token_file), "--token-file")
            token = Path(ns.token_file).read_text().strip()
        except OSError as exc:
            return _fail(ns, EXIT_USAGE, f"--token-file {ns.token_file}: {exc.strerror}", "USAGE")
        except ConfigError as exc:
            return _fail(ns, EXIT_USAGE, str(exc), "USAGE")
    with channel(ns.address) as ch:
        stub = trainer_stub(ch, token, ns.timeout)
        try:
            if ns.command == "status":
                st = stub.GetStatus(trainer_pb2.TrainerStatusRequest())
                print(json.dumps(_as_dict(st), indent=2)) if ns.json else print_status(st)
                return EXIT_OK
            if ns.command == "sync":
                req = trainer_pb2.SyncRequest(
                    rollout_ids=ns.rollout,
                    transport=ns.transport,
                    timeout_seconds=ns.sync_timeout,
                    senders=ns.senders,
                    allow_rollback=ns.allow_rollback,
                )
                if ns.json:  # stdout is the report alone, stderr stays quiet: what a script parses
                    rep = stub.Sync(req).report
                else:
                    from weightsync.wsctl.progress import watch

                    call = stub.future("Sync", req)
                    watch(stub, call, sys.stderr)  # phases and bytes as they happen
                    rep = call.result().report
                if ns.json:
                    out = _as_dict(rep)
                    if not rep.rollouts:  # the report as always, and why it is empty
                        out["error"] = {"code": "NO_ROLLOUTS", "message": NOTHING_TO_SYNC, "exit_code": EXIT_FAILED}
                    print(json.dumps(out, indent=2))
                elif rep.rollouts:
                    print_report(rep)
                else:
                    print(f"wsctl: {NOTHING_TO_SYNC}", file=sys.stderr)
                return EXIT_OK if rep.ok else EXIT_FAILED
            if ns.command == "load":
                resp = stub.LoadWeights(trainer_pb2.LoadWeightsRequest(hf_path=ns.path))
                print(json.dumps(_as_dict(resp))) if ns.json else print(
                    f"loaded {resp.hf_path}: trainer now at version {resp.version}"
                )
                return EXIT_OK
            if ns.command == "export":
                resp = stub.ExportHf(trainer_pb2.ExportHfRequest(out_dir=ns.out_dir))
                print(json.dumps(_as_dict(resp))) if ns.json else print(
                    f"wrote {resp.num_tensors} tensors of version {resp.version} to {resp.out_dir}"
                )
                return EXIT_OK
        except grpc.RpcError as exc:
            code = exc.code()
            failed = code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            return _fail(
                ns,
                EXIT_FAILED if failed else EXIT_UNREACHABLE,
                f"{ns.command} against {ns.address} failed: {describe_rpc_error(exc)}",
                code.name if code is not None else "UNKNOWN",
            )
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
