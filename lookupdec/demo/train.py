"""Train the built-in model: a byte-level BPE tokenizer and small Llama models, offline.

    python -m lookupdec.demo.train tokenizer --out runs/tok
    python -m lookupdec.demo.train data --tokenizer runs/tok --out runs/data
    python -m lookupdec.demo.train model --data runs/data --tokenizer runs/tok --size target \\
        --tokens 20e6 --out runs/target
    python -m lookupdec.demo.train export --checkpoint runs/target --out lookupdec/demo/weights/target

Text comes from ``lookupdec.demo.data`` (the standard library and installed packages). Every
stage is reproducible from ``--seed``; training logs loss and tokens/s as JSON lines
(``log.jsonl`` next to the checkpoint) and evaluates on held-out files. On a GPU, pass
``--device cuda`` (bfloat16 autocast either way). ``model`` resumes from the checkpoint in
``--out`` if there is one.

Kept apart from the package's layers: an offline tool (not imported by the engine, the CLI or
the server) that builds models and tokenizers with ``transformers`` directly, so it is the one
module besides the ``lookupdec/model/`` package that imports ``transformers``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

from lookupdec.demo import data as data_lib

VOCAB_SIZE = 8192
TOKENIZER_SAMPLE_BYTES = 40_000_000  # text the BPE merges are learnt from
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

# Llama shapes (tied embeddings, vocabulary 8192). "target" and "draft" are the CPU-trainable pair
# shipped with the package; "target-30M"/"draft-4M" the sizes meant for a GPU run; "test" for tests.
SIZES = {
    "target": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4),
    "draft": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2),
    "target-30M": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8),
    "draft-4M": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=3),
    "test": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
}
CONTEXT = 1024  # training window = the models' context


# -- tokenizer --------------------------------------------------------------------------------------
def train_tokenizer(out: str, *, vocab_size: int = VOCAB_SIZE, sample_bytes: int = TOKENIZER_SAMPLE_BYTES,
                    seed: int = 0, sources=None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sources = sources if sources is not None else data_lib.split_sources(data_lib.find_sources())[0]

    def texts():
        total = 0
        for doc in data_lib.documents(sources, seed):
            yield doc
            total += len(doc)
            if total >= sample_bytes:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(data_lib.SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=data_lib.EOT, eos_token=data_lib.EOT,
                                   unk_token=None, pad_token=data_lib.PAD,
                                   additional_special_tokens=[data_lib.FIM_PREFIX, data_lib.FIM_SUFFIX,
                                                              data_lib.FIM_MIDDLE])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = CONTEXT
    fast.save_pretrained(out)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# -- token streams ----------------------------------------------------------------------------------
def encode_streams(tokenizer_dir: str, out: str, *, seed: int = 0, max_train_bytes: int | None = None,
                   sources=None) -> dict:
    """Tokenize the training and held-out documents into ``train.npy`` / ``heldout.npy`` (uint16
    token streams, each document followed by the end-of-text token) and ``streams.json``."""
    tokenizer = load_tokenizer(tokenizer_dir)
    eot = tokenizer.convert_tokens_to_ids(data_lib.EOT)
    sources = sources if sources is not None else data_lib.find_sources()
    train, held = data_lib.split_sources(sources)
    os.makedirs(out, exist_ok=True)
    info = {"seed": seed, "sources": len(sources), "train_files": len(train), "heldout_files": len(held),
            "source_bytes": sum(s.size for s in sources),
            "roots": sorted({s.root for s in sources})}
    for name, files, synthetic in (("train", train, True), ("heldout", held, False)):
        ids, done_bytes, batch = [], 0, []

        def flush():
            for enc in tokenizer(batch, add_special_tokens=False).input_ids:
                ids.extend(enc)
                ids.append(eot)
            batch.clear()

        for doc in data_lib.documents(files, seed, synthetic=synthetic):
            batch.append(doc)
            done_bytes += len(doc)
            if len(batch) >= 64:
                flush()
            if max_train_bytes and done_bytes >= max_train_bytes:
                break
        flush()
        array = np.asarray(ids, dtype=np.uint16)
        np.save(os.path.join(out, f"{name}.npy"), array)
        info[f"{name}_tokens"] = int(array.size)
        info[f"{name}_bytes"] = done_bytes
    with open(os.path.join(out, "streams.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


# -- model ------------------------------------------------------------------------------------------
def build_model(size: str, vocab_size: int, tokenizer=None):
    import transformers

    shape = SIZES[size]
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=CONTEXT, tie_word_embeddings=True,
        num_key_value_heads=shape["num_attention_heads"], rope_theta=10000.0, **shape)
    if tokenizer is not None:
        eot = tokenizer.convert_tokens_to_ids(data_lib.EOT)
        config.bos_token_id = config.eos_token_id = eot
        config.pad_token_id = tokenizer.convert_tokens_to_ids(data_lib.PAD)
    return transformers.LlamaForCausalLM(config)


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _batch(stream: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([stream[s : s + length + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def evaluate(model, stream: np.ndarray, *, windows: int = 32, length: int = CONTEXT, device="cpu") -> float:
    """Mean next-token loss (nats) over fixed, evenly spaced windows of the held-out stream."""
    model.eval()
    length = min(length, stream.size - 2)
    starts = np.linspace(0, stream.size - length - 2, windows).astype(np.int64)
    losses = []
    for i in range(0, windows, 8):
        x = _batch(stream, starts[i : i + 8], length).to(device)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
            losses.append(_loss(model, x))
    model.train()
    return float(np.mean(losses))


def _loss(model, x: torch.Tensor) -> float:
    logits = model(input_ids=x[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()


def train_model(data_dir: str, tokenizer_dir: str, out: str, *, size: str, tokens: float, batch_tokens: int = 8192,
                lr: float = 2e-3, warmup: int = 200, seed: int = 0, device: str = "cpu", eval_every: int = 200,
                save_every: int = 100, log=print) -> dict:
    tokenizer = load_tokenizer(tokenizer_dir)
    train = np.load(os.path.join(data_dir, "train.npy"), mmap_mode="r")
    held = np.load(os.path.join(data_dir, "heldout.npy"), mmap_mode="r")
    length = CONTEXT
    rows = max(1, batch_tokens // length)
    total_steps = max(1, int(tokens // (rows * length)))
    torch.manual_seed(seed)
    model = build_model(size, len(tokenizer), tokenizer).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    os.makedirs(out, exist_ok=True)
    ckpt_path = os.path.join(out, "checkpoint.pt")
    step, rng = 0, np.random.default_rng(seed)
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, rng = state["step"], state["rng"]
        log(f"resumed at step {step}")
    params = sum(p.numel() for p in model.parameters())
    meta = {"size": size, "params": params, "config": model.config.to_dict(), "total_steps": total_steps,
            "rows": rows, "length": length, "lr": lr, "warmup": warmup, "seed": seed, "device": device,
            "train_tokens_available": int(train.size), "threads": torch.get_num_threads()}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    log(f"{size}: {params / 1e6:.2f}M params, {total_steps} steps of {rows}x{length} tokens "
        f"({total_steps * rows * length / 1e6:.1f}M tokens; train stream {train.size / 1e6:.1f}M)")
    logf = open(os.path.join(out, "log.jsonl"), "a")
    model.train()
    t_last, tokens_last = time.perf_counter(), 0
    while step < total_steps:
        for group in opt.param_groups:
            group["lr"] = _lr(step, total_steps, lr, warmup)
        starts = rng.integers(0, train.size - length - 1, size=rows)
        x = _batch(train, starts, length).to(device)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_last += rows * length
        record = {"step": step, "loss": round(loss.item(), 4), "lr": opt.param_groups[0]["lr"]}
        if step % 20 == 0 or step == total_steps:
            now = time.perf_counter()
            record["tokens_per_s"] = round(tokens_last / (now - t_last), 1)
            t_last, tokens_last = now, 0
            log(json.dumps(record))
        if step % eval_every == 0 or step == total_steps:
            record["heldout_loss"] = round(evaluate(model, held, device=device), 4)
            log(json.dumps(record))
        logf.write(json.dumps(record) + "\n")
        logf.flush()
        if step % save_every == 0 or step == total_steps:
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "rng": rng}, tmp)
            os.replace(tmp, ckpt_path)
    logf.close()
    return {"params": params, "steps": step, "heldout_loss": evaluate(model, held, device=device)}


def export(checkpoint_dir: str, tokenizer_dir: str, out: str, *, dtype=torch.float16, data_dir: str | None = None) -> str:
    """Write a Hugging Face folder: safetensors in ``dtype``, the tokenizer, and ``training.json``
    (shape, steps, tokens, schedule, the last training and held-out losses from ``log.jsonl``,
    the measured training time, and the token streams' description when ``data_dir`` is given)."""
    meta = json.load(open(os.path.join(checkpoint_dir, "meta.json")))
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build_model(meta["size"], len(tokenizer), tokenizer)
    state = torch.load(os.path.join(checkpoint_dir, "checkpoint.pt"), weights_only=False)
    model.load_state_dict(state["model"])
    model.config.dtype = dtype
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    log = [json.loads(line) for line in open(os.path.join(checkpoint_dir, "log.jsonl"))]
    log = list({r["step"]: r for r in log if r["step"] <= state["step"]}.values())  # a resumed run's last word
    timed = [r for r in log if "tokens_per_s" in r]
    held = [r for r in log if "heldout_loss" in r]
    record = {"size": meta["size"], "params": meta["params"], "shape": SIZES[meta["size"]], "context": CONTEXT,
              "vocab_size": len(tokenizer), "steps": state["step"], "batch": f"{meta['rows']} x {meta['length']} tokens",
              "tokens": state["step"] * meta["rows"] * meta["length"], "peak_lr": meta["lr"], "warmup": meta["warmup"],
              "schedule": "linear warm-up, cosine to 10% of peak", "optimizer": "AdamW (0.9, 0.95), wd 0.1, clip 1.0",
              "precision": "bfloat16 autocast, float32 weights; exported as " + str(dtype).replace("torch.", ""),
              "seed": meta["seed"], "device": meta["device"], "threads": meta.get("threads"),
              "train_seconds": round(sum(20 * meta["rows"] * meta["length"] / r["tokens_per_s"] for r in timed)),
              "last_train_loss": log[-1]["loss"] if log else None,
              "heldout_loss": held[-1]["heldout_loss"] if held else None,
              "heldout_curve": [(r["step"], r["heldout_loss"]) for r in held]}
    if data_dir:
        record["data"] = json.load(open(os.path.join(data_dir, "streams.json")))
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lookupdec.demo.train", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    t = sub.add_parser("tokenizer", help="learn the byte-level BPE tokenizer")
    t.add_argument("--out", required=True)
    t.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    d = sub.add_parser("data", help="tokenize training and held-out documents into token streams")
    d.add_argument("--tokenizer", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--max-train-mb", type=float, default=None)
    m = sub.add_parser("model", help="train a model on the token streams (resumes)")
    m.add_argument("--data", required=True)
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--size", choices=sorted(SIZES), default="target")
    m.add_argument("--tokens", type=float, default=20e6, help="training tokens (20e6)")
    m.add_argument("--batch-tokens", type=int, default=8192)
    m.add_argument("--lr", type=float, default=2e-3)
    m.add_argument("--warmup", type=int, default=200)
    m.add_argument("--device", default="cpu")
    m.add_argument("--threads", type=int, default=None)
    e = sub.add_parser("export", help="write the trained model as a Hugging Face folder (float16 safetensors)")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--tokenizer", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--data", default=None, help="the token streams' folder (described in training.json)")
    for p in (t, d, m):
        p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.stage == "tokenizer":
        train_tokenizer(args.out, vocab_size=args.vocab_size, seed=args.seed)
    elif args.stage == "data":
        max_bytes = int(args.max_train_mb * 1e6) if args.max_train_mb else None
        print(json.dumps(encode_streams(args.tokenizer, args.out, seed=args.seed, max_train_bytes=max_bytes)))
    elif args.stage == "model":
        if args.threads:
            torch.set_num_threads(args.threads)
        result = train_model(args.data, args.tokenizer, args.out, size=args.size, tokens=args.tokens,
                             batch_tokens=args.batch_tokens, lr=args.lr, warmup=args.warmup, seed=args.seed,
                             device=args.device, log=lambda s: print(s, flush=True))
        print(json.dumps(result))
    else:
        export(args.checkpoint, args.tokenizer, args.out, data_dir=args.data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
