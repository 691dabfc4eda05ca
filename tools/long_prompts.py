"""k-shot GSM8K prompts of chosen lengths, made of the recipe's own questions and greedy replies: for
measuring tau against the context length, and for training with long samples in the mix.

    python tools/long_prompts.py --target_model TARGET --replies DATA/greedy.jsonl \
        --heldout DATA/heldout_questions.jsonl --out_dir DATA/long \
        --lengths 200,2000,4000,7000 --num_eval 16 --train_lengths 2048,4096,7680 --num_train 700

A k-shot prompt is one user turn: k exemplars "Question: q\nAnswer: r\n\n" (q a training question,
r the target's greedy reply to it, from regenerate_data.py's --replies file), then the question
itself, as the recipe asks it. Exemplars are added, drawn at random (seeded) for every prompt, while
the prompt, as the target reads it (chat template and generation prompt included), stays within the
length; at 200 tokens that is none: the bare question.

Writes to --out_dir:
  eval.jsonl        {"prompt", "length"} for each --lengths L, the first --num_eval held-out questions at
                    each, grouped by length, shortest first: one eval_dflash.py --data file for all of
                    them; tools/gpu/tau_by_length.py splits its per-prompt results by length.
  train_long.jsonl  {"messages": [user: k-shot prompt + question, assistant: its greedy reply]} for
                    --num_train training questions (seeded choice), their whole length (reply and
                    template included) within the --train_lengths in turn, each using other questions'
                    exemplars. Only the reply trains (the loss mask covers assistant turns), so the
                    reply sits thousands of tokens deep in the context, as after a long prompt.
Prints the prompts' token counts per length.
"""

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_data import load_prompts  # noqa: E402  (the repository root, on the path above)
from dflash_target import load_target_config  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target_model", required=True, help="the target (its tokenizer and chat template count the tokens)")
    p.add_argument("--target_gguf_file", default=None, help="GGUF file name inside --target_model")
    p.add_argument("--replies", required=True, help="regenerate_data.py output: training questions and their greedy replies")
    p.add_argument("--heldout", required=True, help="held-out questions (JSONL with 'question'), never trained on")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--lengths", default="200,2000,4000,7000", help="prompt lengths in tokens for eval.jsonl, comma-separated")
    p.add_argument("--num_eval", type=int, default=16, help="held-out questions per length")
    p.add_argument("--train_lengths", default="2048,4096,7680", help="whole-sample lengths for train_long.jsonl, taken in turn")
    p.add_argument("--num_train", type=int, default=700, help="training questions given a k-shot version (0: no train_long.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("lengths", "train_lengths"):
        try:
            setattr(args, name, [int(n) for n in getattr(args, name).split(",")])
        except ValueError:
            raise ValueError(f"--{name} must be comma-separated token counts, got {getattr(args, name)!r}") from None
    return args


def read_replies(path: str) -> list[tuple[str, str]]:
    """(question, reply) of every non-empty reply in a regenerate_data.py output file."""
    pairs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                user, assistant = record["messages"][-2:]
            except (json.JSONDecodeError, KeyError, ValueError, TypeError):
                raise ValueError(f"{path}:{number}: not a regenerate_data.py record with a question and a reply") from None
            if assistant["content"].strip():  # an unfinished reply (cut at --max_new_tokens) is still the target's text
                pairs.append((user["content"], assistant["content"]))
    if len(pairs) < 2:
        raise ValueError(f"{path}: {len(pairs)} replies; k-shot prompts need at least 2")
    return pairs


class PromptBuilder:
    """Counts tokens as the target reads a prompt, and fills prompts with exemplars up to a length."""

    def __init__(self, tokenizer, exemplars: list[tuple[str, str]]):
        self.tokenizer = tokenizer
        self.exemplars = [f"Question: {q}\nAnswer: {r}\n\n" for q, r in exemplars]
        self.exemplar_tokens = [self.count_text(text) for text in self.exemplars]

    def count_text(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count(self, messages: list[dict], generation_prompt: bool) -> int:
        """Tokens of the messages under the chat template (as eval_dflash.py and training tokenize them)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return self.count_text(text)

    def build(self, question: str, budget: int, rng: random.Random, exclude: int | None = None, reply: str | None = None) -> tuple[str, int]:
        """(prompt, its exact tokens: the prompt alone with the generation prompt, or with `reply` the whole
        conversation) with as many random exemplars (not `exclude`) as keep it within `budget` tokens."""
        order = [i for i in range(len(self.exemplars)) if i != exclude]
        rng.shuffle(order)

        def exact(prompt):
            messages = [{"role": "user", "content": prompt}] + ([{"role": "assistant", "content": reply}] if reply is not None else [])
            return self.count(messages, generation_prompt=reply is None)

        fixed = exact(question)
        chosen, total = [], fixed
        for i in order:  # token counts add up to within a few tokens at the joins: checked exactly below
            if total + self.exemplar_tokens[i] > budget:
                break
            chosen.append(i)
            total += self.exemplar_tokens[i]
        while True:
            prompt = "".join(self.exemplars[i] for i in chosen) + question
            tokens = exact(prompt)
            if tokens <= budget or not chosen:
                return prompt, tokens
            chosen.pop()


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    _, tokenizer = load_target_config(args.target_model, gguf_file=args.target_gguf_file)
    pairs = read_replies(args.replies)
    heldout = [messages[-1]["content"] for messages in load_prompts(args.heldout)][: args.num_eval]
    builder = PromptBuilder(tokenizer, pairs)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    with (out / "eval.jsonl").open("w") as f:
        for length in sorted(args.lengths):
            counts = []
            for question in heldout:
                prompt, tokens = builder.build(question, length, rng)
                counts.append(tokens)
                f.write(json.dumps({"prompt": prompt, "length": length}) + "\n")
            print(f"eval, length {length}: {len(counts)} prompts of {min(counts)}-{max(counts)} tokens (mean {statistics.mean(counts):.0f})")
    if args.num_train > 0:
        chosen = rng.sample(range(len(pairs)), min(args.num_train, len(pairs)))
        counts = {length: [] for length in args.train_lengths}
        with (out / "train_long.jsonl").open("w") as f:
            for n, i in enumerate(chosen):
                length = args.train_lengths[n % len(args.train_lengths)]
                question, reply = pairs[i]
                prompt, tokens = builder.build(question, length, rng, exclude=i, reply=reply)
                counts[length].append(tokens)
                f.write(json.dumps({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]}) + "\n")
        for length, c in counts.items():
            if c:
                print(f"train, length {length}: {len(c)} samples of {min(c)}-{max(c)} tokens (mean {statistics.mean(c):.0f})")
    print(f"wrote {out}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ValueError as error:  # bad input: one line, as the other tools say it
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
