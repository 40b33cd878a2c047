"""A single-process sequence-classification fine-tune in the shape of Hugging Face Accelerate's
examples/nlp_example.py with the Accelerator taken out: AdamW, a linear schedule with warm-up, accuracy
and F1 on an evaluation set whose size no batch divides. The model is a tiny BERT built from a config
(random weights) and the data are synthetic pre-tokenized sentence pairs (label 1: the second sentence
is a lightly edited copy of the first, as in MRPC's paraphrases): nothing to download.

    dptrain launch --nproc-per-node 2 examples/ports/nlp_dptrain.py   # 2 processes, or
    python examples/ports/nlp_dptrain.py                                # a world of one

Ported from nlp_base.py with dptrain (docs/guides/porting.md); the global batch stays batch_size.
"""

import argparse
import json

import torch
from torch.optim import AdamW
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup, set_seed

import dptrain

MAX_GPU_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 32
VOCAB, PAD, CLS, SEP = 100, 0, 1, 2


def synthetic_pairs(n, seed):
    """n pre-tokenized pairs [CLS] a [SEP] b [SEP] of 4-12 word ids each; label 1 when b is a copy of a with
    one or two words changed, 0 when b is unrelated."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        a = torch.randint(3, VOCAB, (int(torch.randint(4, 13, (1,), generator=g)),), generator=g)
        label = int(torch.randint(0, 2, (1,), generator=g))
        if label:
            b = a.clone()
            b[torch.randint(0, len(b), (2,), generator=g)] = torch.randint(3, VOCAB, (2,), generator=g)
        else:
            b = torch.randint(3, VOCAB, (int(torch.randint(4, 13, (1,), generator=g)),), generator=g)
        ids = [CLS, *a.tolist(), SEP, *b.tolist(), SEP]
        types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
        samples.append({"input_ids": ids, "token_type_ids": types, "labels": label})
    return samples


def collate_fn(examples):
    """Pad to the longest sequence of the batch (what tokenizer.pad does)."""
    longest = max(len(e["input_ids"]) for e in examples)
    pad = [longest - len(e["input_ids"]) for e in examples]
    padded = list(zip(examples, pad, strict=True))
    return {
        "input_ids": torch.tensor([e["input_ids"] + [PAD] * p for e, p in padded]),
        "token_type_ids": torch.tensor([e["token_type_ids"] + [0] * p for e, p in padded]),
        "attention_mask": torch.tensor([[1] * len(e["input_ids"]) + [0] * p for e, p in padded]),
        "labels": torch.tensor([e["labels"] for e in examples]),
    }


def get_dataloaders(batch_size, seed, world_size):
    train_dataset, eval_dataset = synthetic_pairs(256, seed), synthetic_pairs(101, seed + 1)
    train_dataloader = dptrain.prepare_dataloader(
        train_dataset, global_batch_size=batch_size, micro_batch_size=min(MAX_GPU_BATCH_SIZE, batch_size // world_size),
        collate_fn=collate_fn, seed=seed,
    )
    eval_dataloader = dptrain.prepare_eval_dataloader(eval_dataset, EVAL_BATCH_SIZE, collate_fn=collate_fn)
    return train_dataloader, eval_dataloader


def compute_metrics(predictions, references):
    tp = int(((predictions == 1) & (references == 1)).sum())
    wrong = int((predictions != references).sum())
    return {"accuracy": float((predictions == references).float().mean()), "f1": 2 * tp / (2 * tp + wrong)}


def training_function(config, args):
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])
    runtime = dptrain.init_distributed()
    device = runtime.device

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(batch_size, seed, runtime.world_size)
    gradient_accumulation_steps = dptrain.grad_accum_steps(train_dataloader)  # micro-batches of MAX_GPU_BATCH_SIZE
    model_config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
        pad_token_id=PAD, num_labels=2,
    )
    model = BertForSequenceClassification(model_config)
    model = dptrain.parallelize(model, device=device).module
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=config["warmup_steps"],
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
    )

    losses, metrics = [], []
    for epoch in dptrain.epochs(train_dataloader, num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch = {k: v.to(device) for k, v in batch.items()}
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            loss.backward()
            losses.append(dptrain.all_reduce_mean(loss.detach()).item())  # the global batch's loss
            if (step + 1) % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

        model.eval()
        all_predictions, all_references = [], []
        for batch in eval_dataloader:
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = dptrain.gather_for_metrics((predictions, batch["labels"]), eval_dataloader)
            all_predictions.append(predictions)
            all_references.append(references)
        eval_metric = compute_metrics(torch.cat(all_predictions), torch.cat(all_references))
        metrics.append(eval_metric)
        dptrain.print0(f"epoch {epoch}:", eval_metric)

    if args.losses and runtime.is_main:
        with open(args.losses, "w") as f:
            json.dump({"loss": losses, "eval": metrics}, f)


def main():
    parser = argparse.ArgumentParser(description="Simple example of a training script.")
    parser.add_argument("--num_epochs", type=int, default=2, help="number of epochs")
    parser.add_argument("--dropout", type=float, default=0.1, help="the model's dropout probability")
    parser.add_argument("--losses", help="write the per-step losses and metrics to this JSON file")
    args = parser.parse_args()
    config = {"lr": 2e-4, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16, "warmup_steps": 4}
    training_function(config, args)


if __name__ == "__main__":
    main()
