"""A small byte-level BPE tokenizer with a ChatML chat template, trained from texts in seconds.

`train_bpe` writes a directory that `transformers.AutoTokenizer.from_pretrained` loads:
tokenizer.json, tokenizer_config.json (Qwen2-style ChatML template) and special_tokens_map.json.
Digits are split one per token before BPE so a number's tokens are its digits, the way Qwen2 and
Llama 3 tokenise arithmetic. Ids 0..2 are `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos);
there is no BOS. The same texts always give byte-identical files. `chat_format` renders the template
in plain Python for code that tokenises with `tokenizers` alone (and is the test's reference).

    python -m jaxrl.data.tiny_tokenizer --data /tmp/gsm8k_synth/train.jsonl --out /tmp/tok
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
ROLES = ("system", "user", "assistant")


def chat_template(system_prompt: str | None = None) -> str:
  """Qwen2's ChatML template; with `system_prompt`, a conversation without a system turn gets it."""
  default = ""
  if system_prompt is not None:
    # json.dumps quoting is also a valid Jinja string literal (same escapes).
    literal = json.dumps(system_prompt, ensure_ascii=False)
    default = ("{%- if not messages or messages[0]['role'] != 'system' %}"
               "{{- '<|im_start|>system\\n' + " + literal + " + '<|im_end|>\\n' }}"
               "{%- endif %}")
  return (default + "{%- for message in messages %}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_format(messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = False,
                system_prompt: str | None = None) -> str:
  """What `chat_template(system_prompt)` renders, without Jinja."""
  out = []
  if system_prompt is not None and (not messages or messages[0]["role"] != "system"):
    out.append(f"{IM_START}system\n{system_prompt}{IM_END}\n")
  out += [f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages]
  if add_generation_prompt:
    out.append(f"{IM_START}assistant\n")
  return "".join(out)


def _build(vocab_size: int, texts: Iterable[str]) -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False),
  ])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  return tok


def _with_roles(texts: Iterable[str]) -> Iterable[str]:
  # The trainer never sees chat formatting, yet every formatted sequence carries a role name; one
  # role line per text lets "user"/"assistant" merge as they would in a real chat corpus.
  for i, text in enumerate(texts):
    yield text
    yield ROLES[1 + i % 2] + "\n"


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, *,
              system_prompt: str | None = None, model_max_length: int = 256,
              atomic: Sequence[str] = ()) -> Tokenizer:
  """Trains on `texts` and writes a transformers-loadable tokenizer directory; returns the model.

  `vocab_size` counts the 256 byte tokens and the 3 special tokens; the caller may round the model's
  embedding size up (ids past the vocabulary are never produced). `atomic`: strings added as
  tokens of their own after `vocab_size` (a tool's tags: `)</python>` is `)` and `</python>`, so
  an environment's stop string is always a token boundary), never split or merged.
  """
  min_size = 256 + len(SPECIAL_TOKENS)
  if vocab_size < min_size:
    raise ValueError(f"vocab_size must be >= {min_size} (bytes + special tokens), got {vocab_size}")
  tok = _build(vocab_size, _with_roles(texts))
  tok.add_tokens(list(atomic))
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  special = {"eos_token": IM_END, "pad_token": PAD, "additional_special_tokens": [IM_START]}
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "bos_token": None,
      "unk_token": None,
      **special,
      "model_max_length": model_max_length,
      "clean_up_tokenization_spaces": False,
      "chat_template": chat_template(system_prompt),
  }
  _write_json(config, os.path.join(out_dir, "tokenizer_config.json"))
  _write_json(special, os.path.join(out_dir, "special_tokens_map.json"))
  return tok


def _write_json(obj: dict, path: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, ensure_ascii=False)
    f.write("\n")


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", required=True, help="a .jsonl of {question, answer} rows")
  parser.add_argument("--out", required=True)
  parser.add_argument("--vocab_size", type=int, default=512)
  parser.add_argument("--system_prompt", default=None)
  args = parser.parse_args(argv)
  with open(args.data, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  texts = [t for r in rows for t in (r["question"], r["answer"])]
  tok = train_bpe(texts, args.vocab_size, args.out, system_prompt=args.system_prompt)
  print(f"wrote a {tok.get_vocab_size()}-token tokenizer to {args.out}")


if __name__ == "__main__":
  main()
