"""Compare a temperature-0 run's tokens with plain greedy decoding of its target.

    python tools/check_greedy.py RUN_DIR [RUN_DIR ...]

For each device in RUN_DIR/outputs.json: encode its prompt as the run did, decode greedily with the run's
target in PyTorch (argmax each step, KV cache, no generation-config extras such as repetition penalties),
for as many tokens as the device produced, and report the first position where they differ. Exit 0 when
every device matches, 1 otherwise. Speculative decoding at temperature 0 is lossless, so any difference is
a defect (or a tie in the target's logits, which the report shows with the two logits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from edge_node.verifier import load_target
from testbed.run.launcher import load_tokenizer, resolve_pair
from testbed.run.profile import load_profile
from testbed.run.session import encode_prompts


@torch.inference_mode()
def greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens after prompt, and the margin (top-1 minus top-2 logit) at each step."""
    out, margins = [], []
    ids = torch.tensor([prompt])
    past = None
    for _ in range(n):
        res = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = res.past_key_values
        logits = res.logits[0, -1].float()
        top2 = torch.topk(logits, 2)
        out.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        ids = top2.indices[:1].view(1, 1)
    return out, margins


def check_run(run_dir: Path) -> bool:
    profile = load_profile(run_dir / "profile.yaml")
    if profile.sampling.temperature != 0:
        print(f"{run_dir}: temperature {profile.sampling.temperature}, not 0: nothing to compare")
        return False
    pair = resolve_pair(profile, progress=False)
    tokenizer = load_tokenizer(pair["tokenizer"])
    model = load_target(pair["target"], device="cpu", dtype=profile.model.dtype)  # the target the run verified with
    outputs = json.loads((run_dir / "outputs.json").read_text())
    ok = True
    for name, entry in sorted(outputs.items()):
        got = [int(t) for t in entry["output_ids"]]
        prompt = encode_prompts(tokenizer, [entry["prompt"]])[0]
        want, margins = greedy(model, prompt, len(got))
        diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if diff is None:
            print(f"{name}: {len(got)} tokens equal greedy decoding of the target "
                  f"(smallest top-1/top-2 logit margin {min(margins, default=float('nan')):.3f})")
        else:
            ok = False
            print(f"{name}: differs at token {diff} of {len(got)}: run {got[diff]}, greedy {want[diff]} "
                  f"(greedy's top-1/top-2 logit margin there {margins[diff]:.4f})")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    args = ap.parse_args()
    return 0 if all([check_run(d) for d in args.run_dirs]) else 1


if __name__ == "__main__":
    sys.exit(main())
