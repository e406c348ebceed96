"""Train a small EAGLE-3 head for SmolLM2-135M-Instruct on the CPU, on text SmolLM2 itself writes.

Two stages, each cached under `--work` (default /tmp/eagle3):

1. data: SmolLM2 answers the Spec-Bench dev prompts (all but summarization's long articles) (greedy, batched, left padded). Forward hooks keep the inputs of
   decoder layers 2, 15 and 27 (EAGLE-3's low / middle / high states, `[2, L // 2, L - 3]`) for every fed token.
2. train: a head in the EAGLE authors' layout (`fc`, one `midlayer`, `norm`, `lm_head` over the answers' most frequent
   tokens, `d2t` / `t2d`), warm-started from SmolLM2's own final norm and head rows, trained with cross-entropy on
   SmolLM2's greedy next tokens, unrolled over `--ttt` draft steps (training-time test: step j feeds the head's own
   output of step j - 1, at the positions drafting uses). Saved in fp16 as `config.json` + `model.safetensors`.

Held out: the demo's prompts (`hf_specdec.tools.prompts.DEMO_PROMPTS`) and the last two prompts of every MT-bench
category of the dev file. Run: `OMP_NUM_THREADS=1 python benchmarks/train_eagle3_smollm.py --out heads/eagle3-smollm2`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
DEV_FILE = "/work/shared/bench/specbench_dev.jsonl"


def split_prompts(path: str = DEV_FILE) -> tuple[list[str], list[str]]:
    """(training prompts, held-out chat prompts): the last two prompts of each MT-bench category are held out."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    held: list[str] = []
    for category in MT_BENCH:
        held += [r["turns"][0] for r in rows if r["category"] == category][-2:]
    # Summarization prompts are whole articles: their prefill would take a third of the CPU budget.
    train = [r["turns"][0] for r in rows if r["turns"][0] not in held and r["category"] != "summarization"]
    return train, held


def aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default target layers: the inputs of decoder layers 2, L // 2 and L - 3."""
    return [2, num_layers // 2, num_layers - 3]


@torch.no_grad()
def generate_data(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int) -> list[dict]:  # noqa: ANN001
    """SmolLM2's greedy answers, with the aux layers' states of every token that was fed (all but the last)."""
    from hf_specdec.tools.prompts import encode_batch

    layers = model.model.layers
    ids = aux_layer_ids(len(layers))
    caught: dict[int, list[torch.Tensor]] = {i: [] for i in ids}
    hooks = [
        layers[i - 1].register_forward_hook(
            lambda m, a, out, i=i: caught[i].append(out if torch.is_tensor(out) else out[0])
        )
        for i in ids
    ]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    samples = []
    try:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
        for start in range(0, len(order), batch_size):
            t0 = time.perf_counter()
            texts = [prompts[i] for i in order[start : start + batch_size]]
            enc = encode_batch(tokenizer, texts)
            for i in ids:
                caught[i].clear()
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
            states = torch.cat([torch.cat(caught[i], dim=1) for i in ids], dim=-1)  # [b, n - 1, 3H]
            width = enc["input_ids"].shape[1]
            for row in range(len(texts)):
                pad = int((enc["attention_mask"][row] == 0).sum())
                tokens = out[row].tolist()
                end = len(tokens)
                for j in range(width, len(tokens)):
                    if tokens[j] in eos:
                        end = j + 1
                        break
                samples.append(
                    {
                        "tokens": torch.tensor(tokens[pad:end]),  # [n]
                        "states": states[row, pad : end - 1].to(torch.float16).clone(),  # [n - 1, 3H]
                        "prompt_len": width - pad,
                    }
                )
            print(f"  data: {start + len(texts)}/{len(prompts)} prompts, {time.perf_counter() - t0:.1f}s", flush=True)
    finally:
        for hook in hooks:
            hook.remove()
    return samples


def draft_vocabulary(samples: list[dict], size: int, vocab: int) -> torch.Tensor:  # [Vd] target ids, increasing
    """The `size` most frequent tokens of the answers (prompt tokens count a quarter), as EAGLE-3's reduced vocab."""
    counts = torch.zeros(vocab)
    for sample in samples:
        tokens, start = sample["tokens"], sample["prompt_len"]
        counts += 0.25 * torch.bincount(tokens[:start], minlength=vocab)[:vocab]
        counts += torch.bincount(tokens[start:], minlength=vocab)[:vocab]
    return torch.sort(torch.topk(counts, size).indices).values


def new_head(model, chosen: torch.Tensor, aux: list[int]):  # noqa: ANN001, ANN201
    """An EAGLE-layout head for SmolLM2 (its layer config): random `fc` and layer, `norm` and `lm_head` warm-started
    from SmolLM2's final norm and head rows (as speculators does). A first try that instead passed the high state
    through `fc` (identity) started from confident "repeat the current token" logits and learned far slower."""
    from transformers import LlamaConfig

    from hf_specdec.proposers.eagle3_head import Eagle3Head

    text = model.config.to_dict()
    fields = {k: text[k] for k in LAYER_FIELDS if k in text}
    config = LlamaConfig(**fields, num_hidden_layers=1, vocab_size=model.config.vocab_size)
    torch.manual_seed(0)
    head = Eagle3Head(config, draft_vocab_size=len(chosen), target_hidden_size=config.hidden_size, aux_layer_ids=aux)
    with torch.no_grad():
        for module in head.midlayer.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=0.02)
        head.norm.weight.copy_(model.model.norm.weight)
        head.lm_head.weight.copy_(model.lm_head.weight[chosen])
        head.d2t.copy_(chosen - torch.arange(len(chosen)))
        head.t2d.zero_()
        head.t2d[chosen] = True
    return head


LAYER_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "rope_theta", "rope_parameters", "max_position_embeddings", "hidden_act", "attention_bias", "mlp_bias",
    "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip


def make_batch(samples: list[dict], draft_id: torch.Tensor, max_len: int) -> dict[str, torch.Tensor]:
    """Pad a few answers to one width T (pairs m = 0..n-2: embed(x_{m+1}) with the state of x_m)."""
    width = min(max_len, max(len(s["tokens"]) for s in samples))
    b = len(samples)
    tokens = torch.zeros(b, width, dtype=torch.long)
    states = torch.zeros(b, width - 1, samples[0]["states"].shape[-1], dtype=torch.float16)
    labels = torch.full((b, width), -100, dtype=torch.long)  # draft id of x_t where x_t is an answer token
    for i, s in enumerate(samples):
        n = min(width, len(s["tokens"]))
        tokens[i, :n] = s["tokens"][:n]
        states[i, : n - 1] = s["states"][: n - 1]
        answer = torch.arange(n) >= s["prompt_len"]
        ids = draft_id[s["tokens"][:n]]
        labels[i, :n] = torch.where(answer & (ids >= 0), ids, -100)
    lengths = torch.tensor([min(width, len(s["tokens"])) for s in samples])
    return {"tokens": tokens, "states": states, "labels": labels, "lengths": lengths}


def ttt_loss(head, embed, batch: dict, steps: int, decay: float = 0.8):  # noqa: ANN001, ANN201
    """Cross-entropy of `steps` unrolled draft steps. Step 0 reads pair m at position m (sees pairs <= m); step j
    feeds x_{m+1+j} with step j-1's output at position m + j, seeing pairs <= m and chain m's own earlier steps:
    what drafting does. Returns (loss, per-step accuracy)."""
    from transformers import DynamicCache

    tokens, labels, lengths = batch["tokens"], batch["labels"], batch["lengths"]
    b, width = tokens.shape
    t = width - 1  # pairs
    m = torch.arange(t)
    valid = m[None, :] < (lengths[:, None] - 1)  # [b, T] pair m exists
    causal = (m[None, :] <= m[:, None])[None] & valid[:, None, :]  # [b, T, T]
    diagonal = torch.eye(t, dtype=torch.bool)[None].expand(b, -1, -1)
    hidden = head.fc(batch["states"].float())  # [b, T, H]
    cache = DynamicCache()
    total, accuracy = 0.0, []
    for j in range(steps):
        inputs = tokens[:, 1 + j :]  # x_{m+1+j}
        inputs = torch.nn.functional.pad(inputs, (0, t - inputs.shape[1]))[:, :t]
        mask = torch.cat([causal] + [diagonal] * j, dim=2)[:, None]  # [b, 1, T, (j+1)T]
        positions = (m + j)[None].expand(b, -1)
        hidden = head(embed(inputs), hidden, mask, positions, cache)  # [b, T, H]
        target = labels[:, 2 + j :]
        target = torch.nn.functional.pad(target, (0, t - target.shape[1]), value=-100)[:, :t]
        logits = head.logits(hidden)  # [b, T, Vd]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        total = total + decay**j * loss
        seen = target >= 0
        accuracy.append(float((logits.argmax(-1) == target)[seen].float().mean()) if seen.any() else 0.0)
    return total, accuracy


def train(model, samples: list[dict], args) -> object:  # noqa: ANN001
    aux = aux_layer_ids(len(model.model.layers))
    chosen = draft_vocabulary(samples, args.draft_vocab, model.config.vocab_size)
    draft_id = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    draft_id[chosen] = torch.arange(len(chosen))
    answer_tokens = torch.cat([s["tokens"][s["prompt_len"] :] for s in samples])
    print(
        f"draft vocab {len(chosen)}: covers {float((draft_id[answer_tokens] >= 0).float().mean()):.3f} of answer tokens"
    )
    head = new_head(model, chosen, aux).train()
    model.requires_grad_(False)  # the target's embeddings are read, never trained
    embed = model.get_input_embeddings()
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["tokens"]))
    batches = [order[i : i + args.train_batch] for i in range(0, len(order), args.train_batch)]
    total_steps = args.epochs * len(batches)
    start, step = time.perf_counter(), 0

    def lr_factor(
        s: int,
    ) -> float:  # warm-up, then linear decay over the steps or the time budget, whichever ends first
        done = max(s / total_steps, (time.perf_counter() - start) / args.budget_s)
        return min(1.0, (s + 1) / 20) * max(0.05, 1 - done)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(epoch)
        for batch_index in torch.randperm(len(batches), generator=g).tolist():
            batch = make_batch([samples[i] for i in batches[batch_index]], draft_id, args.max_len)
            loss, accuracy = ttt_loss(head, embed, batch, args.ttt)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
            schedule.step()
            step += 1
            if step % 10 == 0 or step == total_steps:
                elapsed = time.perf_counter() - start
                accs = " ".join(f"{a:.2f}" for a in accuracy)
                print(
                    f"  step {step}/{total_steps} epoch {epoch} loss {float(loss.detach()):.3f} acc {accs} {elapsed:.0f}s",
                    flush=True,
                )
            if time.perf_counter() - start > args.budget_s:
                print(f"  stopping at the time budget ({args.budget_s}s)")
                return head.eval()
    return head.eval()


def save_head(head, out: Path) -> None:  # noqa: ANN001
    """Write the head in the EAGLE authors' layout: config.json (Llama layer config + draft_vocab_size +
    eagle_aux_hidden_state_layer_ids) and fp16 model.safetensors (no embed_tokens: the target's are used)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in head.config.to_dict().items() if k in LAYER_FIELDS}
    config.update(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
        vocab_size=head.config.vocab_size, draft_vocab_size=head.draft_vocab_size,
        eagle_aux_hidden_state_layer_ids=head.aux_layer_ids,
        rope_theta=head.config.rope_parameters["rope_theta"],  # older transformers (the EAGLE code) read this key torch_dtype="float16",
    )  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"saved {out / 'model.safetensors'}: {(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/eagle3")
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--stage", choices=("data", "train", "all"), default="all")
    parser.add_argument("--out", default="heads/eagle3-smollm2")
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--ttt", type=int, default=3, help="draft steps unrolled in training")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--budget-s", type=float, default=1200.0, help="stop training after this many seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from hf_specdec.tools.smollm import load_smollm2

    model, tokenizer = load_smollm2()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data_path = work / "data.pt"
    if args.stage in ("data", "all") and not data_path.exists():
        prompts, _ = split_prompts()
        prompts = prompts[: args.max_prompts]
        t0 = time.perf_counter()
        samples = generate_data(model, tokenizer, prompts, args.max_new_tokens, args.batch_size)
        torch.save(samples, data_path)
        print(f"data: {len(samples)} answers in {time.perf_counter() - t0:.0f}s -> {data_path}")
    if args.stage in ("train", "all"):
        samples = torch.load(data_path)
        t0 = time.perf_counter()
        head = train(model, samples, args)
        print(f"train: {time.perf_counter() - t0:.0f}s")
        save_head(head, Path(args.out))


if __name__ == "__main__":
    main()
