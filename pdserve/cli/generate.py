"""`pdserve generate`: one offline generation in this process, no servers involved."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate a completion offline, in this process",
        description="Generate a completion for one prompt with the offline engine (no servers).",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="Hugging Face model folder (default: the default model, fetched if needed)",
    )
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens at most (default: 32)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)"
    )
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same output)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.model_fetch import fetch_default_model

    model = args.model if args.model is not None else str(fetch_default_model())
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(model=model)
    prompt = chat_prompt_ids(llm.get_tokenizer(), args.prompt) if args.chat else args.prompt
    outputs = llm.generate([prompt], params)
    print(outputs[0].outputs[0].text, flush=True)
    return 0


def chat_prompt_ids(tokenizer, user_message: str) -> list[int]:
    """Token ids of a one-message chat, ready for the assistant's reply.

    Ids rather than text: the template already holds any BOS the model wants, and encoding its
    text again with special tokens could add a second one.
    """
    if tokenizer is None or not tokenizer.chat_template:
        raise SystemExit("pdserve generate: --chat needs a model folder whose tokenizer has a chat template")
    messages = [{"role": "user", "content": user_message}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
