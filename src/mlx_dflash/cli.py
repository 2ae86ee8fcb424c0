"""``mlx-dflash``: command-line entry point (one sub-command per job)."""

from __future__ import annotations

import argparse
import sys

from .errors import DFlashError


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with DFlash speculative decoding")
    p.add_argument("--model", required=True, help="target model: local folder or Hugging Face id")
    p.add_argument("--draft", required=True, help="DFlash draft: local folder or Hugging Face id")
    p.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None, help="default: the draft's trained block size")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: when the tokenizer has one)")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--verbose", action="store_true", help="print per-cycle acceptance")
    p.set_defaults(func=_run_generate)


def _format_prompt(tokenizer, prompt: str, chat, system) -> str | list[int]:
    use_chat = chat if chat is not None else getattr(tokenizer, "chat_template", None) is not None
    if not use_chat:
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise DFlashError("--chat was given but the tokenizer has no chat template")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _run_generate(args) -> None:
    from .draft import load_draft
    from .engine import generate_text_stats, stream_generate
    from .target import check_compatible, load_target

    if args.max_tokens < 1:
        raise DFlashError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    model, tokenizer = load_target(args.model)
    draft = load_draft(args.draft)
    check_compatible(draft, model)
    prompt = _format_prompt(tokenizer, args.prompt, args.chat, args.system)
    acceptance = []
    for response in stream_generate(model, tokenizer, prompt, draft, max_tokens=args.max_tokens,
                                    block_size=args.block_size, stop=args.stop):
        print(response.text, end="", flush=True)
        if response.acceptance_length is not None:
            acceptance.append(response.acceptance_length)
            if args.verbose:
                print(f"[{response.acceptance_length}]", end="", file=sys.stderr, flush=True)
    print()
    print(generate_text_stats(response, acceptance, args.block_size or draft.block_size))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlx-dflash", description="DFlash speculative decoding for mlx-lm")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except DFlashError as exc:
        print(f"mlx-dflash: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
