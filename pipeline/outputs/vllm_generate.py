"""Greedy generation with vLLM's offline API (`vllm.LLM`) on an export: what `make generate` runs, by file path,
with the Python of the vLLM venv (`make setup-vllm`, or VLLM=<another vllm>). It imports vLLM and the standard
library only: the pipeline's own modules need the dev venv's torch, which is not vLLM's.

Prints one JSON line per prompt: the prompt, the completion's text and token ids, and each completion token's
log-probability as vLLM computed it (the tests hold them against transformers').
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--model", required=True, help="the export directory (HF safetensors, config, tokenizer)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--chat", action="store_true", help="each prompt is a user turn in the tokenizer's chat template")
    # the engine arguments `vllm serve` takes too, spelled as there (pipeline/outputs/serve.py _engine_args)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--kv-cache-memory-bytes", type=int, required=True)
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile or graph capture first")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_seqs=len(args.prompt), seed=0)
    # temperature 0 is vLLM's greedy decoding; logprobs=0 returns the chosen token's own log-probability
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=0)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], sampling)
    else:
        outputs = llm.generate(args.prompt, sampling)
    for prompt, output in zip(args.prompt, outputs):
        completion = output.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        print(json.dumps({"prompt": prompt, "prompt_token_ids": list(output.prompt_token_ids), "text": completion.text,
                          "token_ids": list(completion.token_ids), "logprobs": logprobs}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which imports this file again
    main()
