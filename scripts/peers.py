#!/usr/bin/env python3
"""The peers of `megainfer bench`: HF transformers on the same shape and lengths, same columns.

Modes: `eager` (model.generate with the default dynamic cache; TPOT = (t_gen - t_first) /
(gen - 1)) and `compile`, the gpt-fast recipe: a static KV cache, and the whole decode step
(forward of one token, argmax, the next position) compiled as one function with
torch.compile(mode="reduce-overhead", fullgraph=True), so each step replays one CUDA graph. The
token and the position stay on the device between steps and the host reads the tokens once, at
the end (no host sync per step); TPOT = loop time / (gen - 1). Times are host wall clock around
torch.cuda.synchronize().

With `--prefill-lens 1,32,1024,8192,32768`, time to first token alone for each prompt length:
one forward of the prompt (SDPA attention, a fresh dynamic KV cache filled as the engine fills
its own, only the last position's logits computed) plus the argmax read back to the host;
`sdpa` runs it eagerly, `compile` under torch.compile (one compilation per length, in the
warm-up). Median of --reps after warm-up.
"""
import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

PRESETS = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5),
}


def read_bandwidth_gbps():
    """Streaming read of 4 GiB of random bf16 (a sum touches every byte once, accumulating in
    f32 inside the reduction kernel, no converted copy; random, since some memory systems
    compress uniform data), median of 5 after a warm-up, bytes read only."""
    x = torch.rand((1 << 31,), dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(6):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum(dtype=torch.float32)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    bytes_read = x.numel() * x.element_size()
    del x
    return bytes_read / statistics.median(times[1:]) / 1e9


NO_CD_TUNING = False


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def make_static_cache(model, max_len):
    from transformers import StaticCache
    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # older signature
        return StaticCache(config=model.config, max_batch_size=1, max_cache_len=max_len, device="cuda",
                           dtype=torch.bfloat16)


def run_compiled(model, ids, gen, reps):
    """The gpt-fast recipe: static KV cache, the whole decode step (one token's forward, the
    argmax, the position's increment) under torch.compile(mode="reduce-overhead",
    fullgraph=True). Token and position live on the device; each step's token is copied into a
    preallocated device buffer (CUDA-graph outputs are overwritten by the next replay), and the
    host reads all tokens once at the end."""
    cache = make_static_cache(model, ids.shape[1] + gen + 8)

    def one_step(tok, pos):
        out = model(tok, past_key_values=cache, cache_position=pos, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True), pos + 1

    # gpt-fast's inductor settings: coordinate-descent tuning of the generated kernels' launch
    # parameters (it finds the mat-vec tilings that stream the weights fastest).
    torch._inductor.config.coordinate_descent_tuning = not NO_CD_TUNING
    torch._inductor.config.triton.unique_kernel_names = True
    step = torch.compile(one_step, mode="reduce-overhead", fullgraph=True)
    tokens = torch.zeros((gen,), dtype=torch.long, device="cuda")

    def decode():
        cache.reset()
        n = ids.shape[1]
        out = model(ids, past_key_values=cache, cache_position=torch.arange(n, device="cuda"), use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = torch.tensor([n], device="cuda")
        tokens[0] = tok[0, 0]
        torch.cuda.synchronize()
        t_first = time.perf_counter()
        for i in range(1, gen):
            torch.compiler.cudagraph_mark_step_begin()
            nxt, nxt_pos = step(tok, pos)
            tok = nxt.clone()
            pos = nxt_pos.clone()
            tokens[i] = tok[0, 0]
        torch.cuda.synchronize()
        t_end = time.perf_counter()
        return t_first, t_end, tokens.tolist()

    for _ in range(3):  # compilation and graph capture happen here
        decode()
    ttft, tpot = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        t_first, t_end, toks = decode()
        ttft.append((t_first - t0) * 1e3)
        tpot.append((t_end - t_first) / (gen - 1) * 1e3)
    run_compiled.last_tokens = toks
    return ttft, tpot


def run_eager(model, ids, gen, reps):
    kw = dict(do_sample=False, pad_token_id=0)
    first = lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    full = lambda: model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, **kw)
    first()
    run_eager.last_tokens = full()[0, ids.shape[1]:].tolist()
    ttft, tpot = [], []
    for _ in range(reps):
        t1 = timed(first)
        tg = timed(full)
        ttft.append(t1 * 1e3)
        tpot.append((tg - t1) / (gen - 1) * 1e3)
    return ttft, tpot


def prefill_ttft(model, vocab, lens, modes, reps):
    """Time to first token per prompt length and mode (ms), see the module docstring."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    else:
        model.config._attn_implementation = "sdpa"
    from transformers import DynamicCache

    def once(fwd, ids):
        out = fwd(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax().item())

    rows = []
    for n in lens:
        ids = torch.randint(0, vocab, (1, n), device="cuda")
        row = dict(prompt_len=n)
        for mode in modes:
            try:
                fwd = model.forward if mode == "sdpa" else torch.compile(model.forward, dynamic=False)
                for _ in range(3):  # warm-up (and compilation)
                    once(fwd, ids)
                times = [timed(lambda: once(fwd, ids)) * 1e3 for _ in range(reps)]
                row[mode] = statistics.median(times)
            except Exception as e:  # one mode failing (e.g. out of memory) must not hide the others
                row[mode] = None
                row[mode + "_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            torch.cuda.empty_cache()
        rows.append(row)
        cells = " | ".join(
            f"{row[m]:.2f} ms ({n / row[m] * 1e3:.0f} tok/s)" if row[m] is not None else row[m + "_error"]
            for m in modes)
        print(f"| {n} | {cells} |", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS))
    src.add_argument("-m", "--model")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--bandwidth-gbps", type=float)
    ap.add_argument("--json")
    ap.add_argument("--prefill-lens", help="comma-separated prompt lengths: time to first token only")
    ap.add_argument("--prefill-modes", default="sdpa,compile")
    ap.add_argument("--no-cd-tuning", action="store_true",
                    help="compile without inductor's coordinate-descent tuning (gpt-fast turns it on)")
    a = ap.parse_args()
    global NO_CD_TUNING
    NO_CD_TUNING = a.no_cd_tuning

    torch.manual_seed(0)
    if a.preset:
        model = LlamaForCausalLM(LlamaConfig(**PRESETS[a.preset])).to(torch.bfloat16)
    else:
        model = LlamaForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16)
    model = model.cuda().eval()
    # Bytes a token streams, as megainfer counts them: each distinct parameter once (a tied
    # embedding is the LM head's read); an untied embedding table is only looked up, one row.
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    if not model.config.tie_word_embeddings:
        weight_bytes -= model.model.embed_tokens.weight.numel() * 2
    bw = a.bandwidth_gbps or read_bandwidth_gbps()
    if a.prefill_lens:
        lens = [int(x) for x in a.prefill_lens.split(",")]
        modes = a.prefill_modes.split(",")
        print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | transformers"
              f" {transformers.__version__} | model: {a.preset or a.model} | reps {a.reps} | host wall clock,"
              f" forward of the prompt + argmax to the host")
        print("| prompt | " + " | ".join(f"torch {m} TTFT" for m in modes) + " |")
        print("| ---: | " + " | ".join("---:" for _ in modes) + " |")
        with torch.inference_mode():
            rows = prefill_ttft(model, model.config.vocab_size, lens, modes, a.reps)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(prefill=rows), f, indent=1)
        print("peers: done")
        return
    ids = torch.randint(0, model.config.vocab_size, (1, a.prompt_len), device="cuda")

    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | transformers {transformers.__version__}"
          f" | model: {a.preset or a.model} | prompt {a.prompt_len} | gen {a.gen} | reps {a.reps}"
          f" | weights/token {weight_bytes / 1e9:.3f} GB | read bandwidth {bw:.0f} GB/s"
          f" ({'given' if a.bandwidth_gbps else 'measured'}) | host wall clock")
    print("| path | TPOT median ms | TPOT min–max ms | tok/s | GB/s | % of BW | TTFT ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    results = []
    with torch.inference_mode():
        for mode in a.modes.split(","):
            name = {"eager": "hf-eager", "compile": "hf-compile-static"}[mode]
            try:
                run = run_compiled if mode == "compile" else run_eager
                ttft, tpot = run(model, ids, a.gen, a.reps)
            except Exception as e:  # one mode failing must not hide the other
                print(f"| {name} | failed: {type(e).__name__}: {str(e)[:120]} | | | | | |")
                continue
            med = statistics.median(tpot)
            gbps = weight_bytes / (med * 1e-3) / 1e9
            print(f"| {name} | {med:.4f} | {min(tpot):.4f}–{max(tpot):.4f} | {1e3 / med:.1f} | {gbps:.0f} |"
                  f" {100 * gbps / bw:.1f}% | {statistics.median(ttft):.2f} |")
            results.append(dict(path=name, tpot_ms_median=med, tpot_ms_min=min(tpot), tpot_ms_max=max(tpot),
                                ttft_ms_median=statistics.median(ttft), gb_per_s=gbps))
    # A sanity check of the compiled loop: its greedy tokens against generate()'s. bf16
    # rounding differs between the two, so on random weights they may part after a near-tie;
    # a loop that fed the wrong token or position parts at once.
    eager_toks, comp_toks = getattr(run_eager, "last_tokens", None), getattr(run_compiled, "last_tokens", None)
    if eager_toks and comp_toks:
        same = next((i for i, (x, y) in enumerate(zip(eager_toks, comp_toks)) if x != y), min(len(eager_toks), len(comp_toks)))
        print(f"greedy tokens: compiled loop and generate() agree on the first {same} of {len(comp_toks)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(weight_bytes_per_token=weight_bytes, read_bandwidth_gbps=bw, results=results), f, indent=1)
    print("peers: done")


if __name__ == "__main__":
    main()
