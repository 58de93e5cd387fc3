"""vLLM loads an exported directory: greedy play and its log-probs equal transformers'.

Run as a script (``python tests/vllm/export_scenario.py <exported dir> <out.json>``) by
tests/vllm/test_export_vllm.py: vLLM changes process-wide state, so its engine lives in a
subprocess, and the ``__main__`` guard keeps any process vLLM spawns from rerunning it.
"""

from __future__ import annotations

import json
import sys

MAX_TOKENS = 12


def hf_greedy(path: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens after ``prompt`` and their log-probs under the transformers model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS)[
            0
        ].tolist()
        gen = out[len(prompt) :]
        logits = model(input_ids=torch.tensor([out])).logits[0, len(prompt) - 1 : -1]  # [G, V]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(gen)[:, None])[
            :, 0
        ]
    return gen, logp.tolist()


def vllm_greedy(path: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        enable_chunked_prefill=False,
        max_num_batched_tokens=8192,
        kv_cache_memory_bytes=64 << 20,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[
        0
    ]
    logprobs = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs)]
    return list(out.token_ids), logprobs


def main(path: str, out: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Your move."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    hf_tokens, hf_logprobs = hf_greedy(path, list(prompt))
    vllm_tokens, vllm_logprobs = vllm_greedy(path, list(prompt))
    with open(out, "w") as f:
        json.dump(
            {
                "prompt": list(prompt),
                "hf_tokens": hf_tokens,
                "hf_logprobs": hf_logprobs,
                "vllm_tokens": vllm_tokens,
                "vllm_logprobs": vllm_logprobs,
            },
            f,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
