"""mlx-lm's own greedy decoding of a model directory, in a process of its own (so it loads the BLAS that its
environment names, as a runner does).

    python mlx_lm_greedy.py MODEL_DIR PROMPTS.json MAX_TOKENS

prints JSON: for each prompt the tokens stream_generate yields (without a final EOS) and, per step (the EOS
step included), the margin
between the two largest logits (a step whose margin is below 1e-3 is a near-tie that float rounding may flip),
and which BLAS the process multiplied with.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import stream_generate


def main() -> None:
    model_dir, prompts_path, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, tokenizer = load(model_dir)
    outputs = []
    for prompt in json.loads(open(prompts_path).read()):
        tokens, margins = [], []
        for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
            top2 = mx.sort(response.logprobs)[-2:]  # log-softmax shifts every logit alike: same margin
            margins.append(float(top2[1] - top2[0]))
            if response.finish_reason == "stop" and response.token in tokenizer.eos_token_ids:
                break
            tokens.append(response.token)
        outputs.append({"tokens": tokens, "margins": margins})
    maps = open("/proc/self/maps").read() if sys.platform == "linux" else ""
    print(json.dumps({"outputs": outputs, "blas": "openblas" if "libopenblas" in maps else "reference"}))


if __name__ == "__main__":
    main()
