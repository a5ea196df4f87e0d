"""The one command-line runner of both services: `<prog> serve [flags]` plus pass-through tools.

trainer-svc and rollout-svc differ only in their config class, env prefix and how they build the
app; parsing, the precedence rule, config errors (exit 2), logging setup and start-up errors
(exit 1) are handled here once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.config import ConfigError, add_arguments, resolve
from weightsync.debug import configure as configure_debug
from weightsync.obs import tracing
from weightsync.obs.logs import setup_logging


@dataclass
class Service:
    prog: str  # e.g. "trainer-svc"
    description: str
    serve_help: str
    config_cls: type
    env_prefix: str  # e.g. "WS_TRAINER"
    #: builds the app from a validated config; returns an object with run_forever(), or None when this
    #: process has nothing to serve (e.g. a trainer worker rank that already ran to completion)
    make_app: Callable[[Any], Any]
    #: name -> (help, main(argv) -> exit code): tools that parse their own arguments
    tools: Mapping[str, tuple[str, Callable[[list[str]], int]]] = ()  # type: ignore[assignment]

    def build_parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=self.prog, description=self.description)
        sub = parser.add_subparsers(dest="command", required=True)
        # no abbreviations: `--auth-token X` would otherwise be taken as `--auth-token-file X`
        serve = sub.add_parser("serve", help=self.serve_help, allow_abbrev=False)
        add_arguments(serve, self.config_cls, self.env_prefix)
        for name, (help_text, _) in dict(self.tools).items():
            sub.add_parser(name, help=help_text, add_help=False)
        return parser

    def main(self, argv: list[str] | None = None) -> int:
        argv = sys.argv[1:] if argv is None else list(argv)
        tools = dict(self.tools)
        if argv and argv[0] in tools:
            return tools[argv[0]][1](argv[1:])
        ns = self.build_parser().parse_args(argv)
        try:
            cfg = resolve(self.config_cls, ns, self.env_prefix)
        except ConfigError as exc:
            print(f"{self.prog}: config error: {exc}", file=sys.stderr)
            return 2
        setup_logging(self.prog, cfg.log.log_level, cfg.log.log_format)
        tracing.setup(self.prog)  # spans only when OTEL_EXPORTER_OTLP_ENDPOINT is set
        configure_debug(cfg.debug.switches())  # before anything reads a switch (every rank)
        try:
            app = self.make_app(cfg)
        except (RuntimeError, ValueError, ConfigError) as exc:
            print(f"{self.prog}: cannot start: {exc}", file=sys.stderr)
            return 1
        if app is not None:
            app.run_forever()
        return 0
