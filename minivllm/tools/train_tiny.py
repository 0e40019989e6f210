"""Train the book's embedded models on Tiny Shakespeare.

    python -m minivllm.tools.train_tiny --corpus ../shared/data/tinyshakespeare.txt

Writes two Hugging Face checkpoints that share one BPE tokenizer:

    minivllm/models/tiny-shakespeare        the default model (Qwen3 architecture, ~3.7M parameters)
    minivllm/models/tiny-shakespeare-draft  a draft model for speculative decoding (<1M parameters)

Training uses transformers' own Qwen3ForCausalLM, so the folders are plain Hugging Face checkpoints
that `AutoModelForCausalLM.from_pretrained` loads; the book is about inference, not training.
Not run by CI: about 45 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"  # minivllm/models, where the loader finds them
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MODEL_SHAPES = {
    "tiny-shakespeare": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32,
    ),
    "tiny-shakespeare-draft": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    ),
}


def train_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def make_tokenizer_config_portable(folder: Path) -> None:
    """Rewrite the tokenizer_config.json that transformers 5 saved so that transformers 4.x loads it too
    (guidellm and other tools pin transformers < 5). transformers 5 names the class `TokenizersBackend`, a
    name 4.x does not know; both know `PreTrainedTokenizerFast`, which 5 maps to the same class, and both build
    it from tokenizer.json alone, so the token ids do not change. The chat template also goes into the config,
    where transformers before 4.50 looks for it (5 reads chat_template.jinja, which stays)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if (folder / "chat_template.jinja").is_file():
        config["chat_template"] = (folder / "chat_template.jinja").read_text()
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def make_model(shape: dict, vocab_size: int, eos_id: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id,
        pad_token_id=eos_id, **shape,
    )
    return Qwen3ForCausalLM(config)


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, batches: int = 20, batch_size: int = 16) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(batches):
        x, y = random_batch(data, seq_len, batch_size, gen)
        losses.append(model(input_ids=x, labels=y).loss.item())
    model.train()
    return sum(losses) / len(losses)


def random_batch(data: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator):
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    x = torch.stack([data[s : s + seq_len] for s in starts])
    return x, x.clone()  # transformers shifts the labels itself


def train(name, tokenizer, train_ids, val_ids, args, log):
    shape = MODEL_SHAPES[name]
    model = make_model(shape, len(tokenizer), tokenizer.eos_token_id, args.seed)
    params = sum(p.numel() for p in model.parameters())
    minutes = args.minutes if name == "tiny-shakespeare" else args.draft_minutes
    log(f"{name}: {params:,} parameters, training for {minutes} minutes")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    start = time.time()
    budget = minutes * 60
    step, best = 0, (float("inf"), 0, None)  # (validation loss, step, weights): the corpus is small enough to overfit
    model.train()
    while time.time() - start < budget:
        # cosine decay over the wall-clock budget, after a short warm-up
        progress = (time.time() - start) / budget
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = random_batch(train_ids, args.seq_len, args.batch_size, gen)
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            log(f"  step {step:5d}  {time.time() - start:6.0f}s  lr {lr:.2e}  train loss {loss.item():.3f}")
        step += 1
        if step % 100 == 0:
            val_loss = evaluate(model, val_ids, args.seq_len)
            log(f"  step {step:5d}  validation loss {val_loss:.3f}")
            if val_loss < best[0]:
                best = (val_loss, step, {k: v.clone() for k, v in model.state_dict().items()})
    elapsed = time.time() - start
    val_loss = evaluate(model, val_ids, args.seq_len)
    if best[0] < val_loss:  # keep the weights that generalised best, not the last ones
        val_loss, step, weights = best
        model.load_state_dict(weights)
    log(f"{name}: kept step {step} of {elapsed / 60:.1f} min, validation loss {val_loss:.3f}")
    return model, dict(parameters=params, steps=step, minutes=round(elapsed / 60, 1),
                       val_loss=round(val_loss, 3), tokens_seen=step * args.batch_size * args.seq_len)


def samples(model, tokenizer, prompt="ROMEO:", max_new_tokens=60):
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    greedy = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    torch.manual_seed(0)
    sampled = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=0, top_p=1.0)
    return tokenizer.decode(greedy[0]), tokenizer.decode(sampled[0])


def write_card(folder: Path, name: str, stats: dict, corpus_stats: dict, greedy: str, sampled: str, shape: dict):
    role = ("the default model of the book" if name == "tiny-shakespeare"
            else "the draft model for the speculative-decoding chapter; same tokenizer as tiny-shakespeare")
    card = f"""---
license: mit
language: en
library_name: transformers
pipeline_tag: text-generation
---
# {name}

A Qwen3-architecture causal language model, {role}, trained from scratch by
`python -m minivllm.tools.train_tiny` on Tiny Shakespeare.

- Parameters: {stats['parameters']:,} (tied input/output embeddings)
- Shape: {json.dumps(shape)}
- Tokenizer: byte-level BPE, {corpus_stats['vocab_size']} tokens, trained with `tokenizers` on the same corpus
- Training: {stats['minutes']} minutes on 2 CPU cores; the weights kept are those of step {stats['steps']}
  ({stats['tokens_seen']:,} tokens seen), the best validation loss of the run
- Validation loss (last 10% of the corpus, cross-entropy per token): {stats['val_loss']}

## Data
Tiny Shakespeare (about 1.1 MB, public domain), as distributed with Andrej Karpathy's char-rnn:
`data/tinyshakespeare/input.txt` in the char-rnn repository. The first 90% of its tokens train, the last 10% validate.

## Samples from "ROMEO:"
Greedy (temperature 0):

```
{greedy}
```

Sampled (temperature 0.8, seed 0):

```
{sampled}
```

It writes Shakespeare-shaped text, not sense: it is a few million parameters trained for minutes.
"""
    (folder / "README.md").write_text(card)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, type=Path)
    parser.add_argument("--out", type=Path, default=MODELS_DIR)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--minutes", type=float, default=35)
    parser.add_argument("--draft-minutes", type=float, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if not args.corpus.is_file():
        parser.error(f"--corpus {args.corpus}: no such file")
    if args.threads:
        torch.set_num_threads(args.threads)

    def log(message):
        print(message, flush=True)

    text = args.corpus.read_text(encoding="utf-8")
    tokenizer = train_tokenizer(text, args.vocab_size)
    ids = torch.tensor(tokenizer(text).input_ids, dtype=torch.long)
    split = int(0.9 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]
    corpus_stats = dict(vocab_size=len(tokenizer), tokens=len(ids), chars_per_token=round(len(text) / len(ids), 2))
    log(f"tokenizer: {corpus_stats}")

    for name in MODEL_SHAPES:
        model, stats = train(name, tokenizer, train_ids, val_ids, args, log)
        greedy, sampled = samples(model, tokenizer)
        log(f"greedy: {greedy!r}\nsampled: {sampled!r}")
        folder = args.out / name
        folder.mkdir(parents=True, exist_ok=True)
        model.generation_config.do_sample = False
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        make_tokenizer_config_portable(folder)
        write_card(folder, name, stats, corpus_stats, greedy, sampled, MODEL_SHAPES[name])
        settings = {k: str(v) for k, v in vars(args).items() if k != "out"}  # where it was written is no setting
        (folder / "training.json").write_text(json.dumps({**stats, **corpus_stats, "args": settings}, indent=2))
        log(f"saved {folder}")


if __name__ == "__main__":
    main()
