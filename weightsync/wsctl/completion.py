"""Shell completion for wsctl, generated from its own argument parser (so it never drifts).

`wsctl completion bash` prints a bash script: `source <(wsctl completion bash)` in ~/.bashrc.
`wsctl completion zsh` prints the same script behind zsh's bashcompinit.
"""

from __future__ import annotations

import argparse


def _words(parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, list[str]]]:
    """(global options, subcommand -> its options and choices)."""
    glob, subs = [], {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                words = [s for a in sub._actions for s in a.option_strings]
                words += [str(c) for a in sub._actions if a.choices and not a.option_strings for c in a.choices]
                subs[name] = sorted(set(words))
        else:
            glob += action.option_strings
    return sorted(set(glob)), subs


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    glob, subs = _words(parser)
    cases = "\n".join(f'        {name}) opts="{" ".join(words)}" ;;' for name, words in sorted(subs.items()))
    bash = f"""_wsctl() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" sub="" w
    for w in "${{COMP_WORDS[@]:1:COMP_CWORD-1}}"; do
        case "$w" in {"|".join(sorted(subs))}) sub="$w" ;; esac
    done
    local opts="{" ".join(glob)} {" ".join(sorted(subs))}"
    case "$sub" in
{cases}
    esac
    COMPREPLY=($(compgen -W "$opts" -- "$cur"))
}}
complete -o default -F _wsctl wsctl
"""
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + bash
    return bash
