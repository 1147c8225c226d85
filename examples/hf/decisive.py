"""A model whose logits decide, for examples/hf/check.py to compare greedy tokens on:
a small Llama trained for a few seconds on the GPU host, from a fixed seed, on text that
ships with Python (the standard library's own .py files), read as bytes (a vocabulary
of 256, no tokenizer, no download). Random weights make near-ties common, so that two
correct attention paths in bf16 pick different tokens; a model that has learnt some
Python predicts its next byte by a wide margin, and its greedy tokens through the pool
must equal transformers' own, every one.

It trains on windows of WINDOW (8192) bytes, so every position up to 8k is one it was
trained at (RoPE); past 8k its greedy tokens are reported, not required.

    python3 examples/hf/decisive.py [--steps N] [--device cuda:0]   # trains and prints the loss

check.py calls train() and held_out(); nothing is saved.
"""

import argparse
import os
import sys
import sysconfig
import time

WINDOW = 8192  # bytes a training sequence holds: positions up to this are trained
SEED = 31
# The model: ~13M parameters; 4 layers x 4 KV heads x 64 x bf16 = 2 KiB of KV a token.
CONFIG = dict(model_type="llama", vocab_size=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=65536,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
STEPS = 400  # about 15 s on an H200 (the time is printed: adjust STEPS, not a clock, to keep it deterministic)
BATCH = 2
LR = 3e-3
WARMUP = 40
HELD_OUT = 0.1  # the last tenth of the text is not trained on: the prompts come from it


def corpus():
    """The standard library's top-level .py files, in name order, joined by a newline:
    bytes that every Python installation ships (their version's own)."""
    lib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(lib) if n.endswith(".py"))
    parts = []
    for n in names:
        with open(os.path.join(lib, n), "rb") as f:
            parts.append(f.read())
    text = b"\n".join(parts)
    if len(text) < 20 * WINDOW:
        raise RuntimeError("the standard library at %s has only %d bytes of .py files" % (lib, len(text)))
    return text


def split(text):
    """(training bytes, held-out bytes)."""
    cut = int(len(text) * (1 - HELD_OUT))
    return text[:cut], text[cut:]


def held_out(n, offset=0, text=None):
    """n held-out bytes as token ids (ints 0..255), offset bytes into the held-out part
    (which repeats where it is too short): a prompt the model was not trained on."""
    _, rest = split(text if text is not None else corpus())
    rest = rest * (-(-(offset + n) // len(rest)))
    return list(rest[offset:offset + n])


def build(device):
    """The untrained model on device, float32 (trained so, then cast), attending with
    SDPA; greedy generation never stops early (no EOS token)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = dict(CONFIG)
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(SEED)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def train(device="cuda:0", steps=STEPS, log=print):
    """The model trained for steps steps of BATCH windows of WINDOW bytes drawn from the
    training text by a generator seeded with SEED (AdamW, linear warm-up then cosine
    decay, bf16 autocast), returned in bf16, in eval mode. log gets a line now and then."""
    import math
    import torch
    text, _ = split(corpus())
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device=device, dtype=torch.long)
    m = build(device)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator(device="cpu").manual_seed(SEED)
    kind = torch.device(device).type
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda *_: None)
    sync(device)
    t0 = time.perf_counter()
    for step in range(steps):
        lr = LR * min(1.0, (step + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - WINDOW - 1, (BATCH,), generator=g).tolist()
        x = torch.stack([data[s:s + WINDOW] for s in starts])
        with torch.autocast(kind, dtype=torch.bfloat16):
            loss = m(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log("  train step %d/%d: loss %.3f nats a byte, %.1f s" % (step + 1, steps, loss.item(),
                                                                       time.perf_counter() - t0))
    sync(device)
    log("  trained %d steps of %d x %d bytes in %.1f s" % (steps, BATCH, WINDOW, time.perf_counter() - t0))
    m.eval()
    with torch.no_grad():
        for p in m.parameters():  # buffers such as rotary's inv_freq stay float32, as trained
            p.requires_grad_(False)
            p.data = p.data.to(torch.bfloat16)
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--device", default="cuda:0", help="cpu smoke-tests it (slowly: try --steps 2)")
    args = ap.parse_args()
    text = corpus()
    print("corpus: %d bytes of the standard library's .py files (%s)" % (len(text), sysconfig.get_paths()["stdlib"]))
    train(args.device, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
