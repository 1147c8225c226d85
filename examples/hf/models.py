"""The models cudapool's examples serve over the KV page pool: transformers' own model
classes built from configs with seeded random weights (no downloads), the same bits in
every process of one GPU type. examples/hf/check.py checks them against transformers;
examples/replicas/run.py serves the Llama from several processes.

    m = build("llama", seed=1, attn=cudapool.hf.register())   # on the current GPU, bf16
"""

STD = 0.02  # the weights' standard deviation (norm weights are 1)

ARCHS = {
    # ~0.85B: 16 layers x 2 x 8 KV heads x 64 x bf16 = 32 KiB of KV a token (kvpoold -layout llama-0.85b)
    "llama": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                  max_position_embeddings=65536, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Qwen3-like, ~1.1B: q and k norms, 20 layers, 4 KV heads x 128 (40 KiB of KV a token)
    "qwen3": dict(model_type="qwen3", vocab_size=32000, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                  max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  use_sliding_window=False),
}


def kvpoold_flags(arch, tokens_per_page=16):
    """kvpoold's geometry flags for the model of ARCHS[arch]."""
    return geometry_flags(ARCHS[arch], tokens_per_page)


def geometry_flags(a, tokens_per_page=16):
    """kvpoold's geometry flags for a model of config a (bf16)."""
    return ["-layers", str(a["num_hidden_layers"]), "-kv-heads", str(a["num_key_value_heads"]),
            "-head-dim", str(a["head_dim"]), "-dtype", "bf16", "-tokens-per-page", str(tokens_per_page)]


def use_attention(model, name):
    """Makes model attend with the registered attention name ("sdpa", cudapool.hf's)."""
    f = getattr(model, "set_attn_implementation", None)
    if f is not None:
        try:
            f(name)
            return
        except Exception as e:  # an older transformers: the config's attribute is what layers read
            print("  (set_attn_implementation(%r): %s: %s; setting the config's)" % (name, type(e).__name__, e))
    model.config._attn_implementation = name


def build(arch, seed=1, attn="sdpa"):
    """The model of ARCHS[arch] on the current GPU, bf16, attending with attn, every
    weight drawn in parameter order from one generator seeded with seed on the GPU
    (norm weights 1); greedy generation never stops early (no EOS token)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = dict(ARCHS[arch])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    dev = torch.device("cuda", torch.cuda.current_device())
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            m = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    finally:
        torch.set_default_dtype(prev)
    m.eval()
    with torch.no_grad():
        for p in m.parameters():  # (buffers such as rotary's inv_freq stay float32)
            if p.dtype != torch.bfloat16 or p.device != dev:
                p.data = p.data.to(device=dev, dtype=torch.bfloat16)
        g = torch.Generator(device=dev).manual_seed(seed)
        for _, p in m.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, STD, generator=g)
    use_attention(m, attn)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def fingerprint(model):
    """An exact checksum of every weight's bits (integer sums: order-independent)."""
    import torch
    s = torch.zeros((), dtype=torch.int64, device=model.device)
    for i, p in enumerate(model.parameters()):
        s += (p.view(torch.int16).to(torch.int64).sum() * (i + 1)) % (1 << 40)
    return int(s)


def params(model):
    return sum(p.numel() for p in model.parameters())
