"""lossmask's labels against LLaMA-Factory's own supervised processor, on the demo files of its ``data/`` folder.

    python benchmarks/peer_llamafactory.py --llamafactory /path/to/llamafactory-0.9.5 [--rows 200]

``--llamafactory`` is the unpacked source package (``pip download --no-deps --no-binary :all: llamafactory==0.9.5``,
then untar). Its ``src`` is imported as it is, nothing installed: the modules its data code imports but never calls
here (peft, trl, accelerate, audio and video readers, ...) stand in as empty modules. Each dataset is read through
its ``dataset_info.json`` entry by both: LLaMA-Factory's converter and ``SupervisedDatasetProcessor`` (cutoff_len
large, train_on_prompt and mask_history off: its defaults), and ``lossmask.mask_files(dataset_info=..., dataset=...)``,
on the fixture tokenizer of the family each LLaMA-Factory template is written for. A row agrees when the two train
the same tokens, in order; the figures print per dataset and template, with the first difference of each kind.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import re
import sys
import tempfile
import types
import warnings
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

DATASETS = ("alpaca_en_demo", "alpaca_zh_demo", "identity", "glaive_toolcall_en_demo", "glaive_toolcall_zh_demo")
# LLaMA-Factory template -> the fixture family whose tokenizer it is written for
TEMPLATES = {"qwen": "qwen2.5", "llama3": "llama-3.1", "mistral": "mistral-v3"}
ABSENT = ("peft", "trl", "accelerate", "av", "librosa", "omegaconf", "fire", "gradio", "torchaudio")


class _Anything:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getattr__(self, name):
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)


class _Absent(types.ModuleType):
    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for the packages LLaMA-Factory's data code imports and this comparison never calls."""

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] in ABSENT else None

    def create_module(self, spec):
        return _Absent(spec.name)

    def exec_module(self, module):
        pass


def llamafactory_labels(source: Path, data: Path, name: str, template_name: str, tokenizer_dir: Path, rows: int):
    """(input_ids, labels) per row, as LLaMA-Factory's supervised processor makes them."""
    from transformers import AutoTokenizer

    from llamafactory.data.converter import get_dataset_converter
    from llamafactory.data.parser import get_dataset_list
    from llamafactory.data.processor.supervised import SupervisedDatasetProcessor
    from llamafactory.data.template import get_template_and_fix_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    # the fields of DataArguments its template, converter and processor read, at their defaults
    args = types.SimpleNamespace(template=template_name, dataset_dir=str(data), media_dir=str(data), cutoff_len=1 << 20,
                                 train_on_prompt=False, mask_history=False, tool_format=None, default_system=None,
                                 enable_thinking=True, neat_packing=False, packing=False)
    template = get_template_and_fix_tokenizer(tokenizer, args)
    attr = get_dataset_list([name], str(data))[0]
    converter = get_dataset_converter(attr.formatting, attr, args)
    processor = SupervisedDatasetProcessor(template=template, tokenizer=tokenizer, processor=None, data_args=args)
    text = (data / attr.dataset_name).read_text(encoding="utf-8")
    examples = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in text.splitlines()]
    out = []
    for example in examples[:rows]:
        row = converter(example)
        ids, labels = processor._encode_data_example(
            prompt=row["_prompt"], response=row["_response"], system=row["_system"], tools=row["_tools"],
            images=[], videos=[], audios=[])
        out.append((ids, labels))
    return out


def lossmask_labels(data: Path, name: str, family: str, rows: int, folder: Path):
    from conftest import chat_tokenizer
    from lossmask import mask_files

    examples_text = (data / json.loads((data / "dataset_info.json").read_text())[name]["file_name"]).read_text()
    examples = [{**example, "peer_row": i} for i, example in enumerate(json.loads(examples_text)[:rows])]
    info = folder / "dataset_info.json"
    entry = json.loads((data / "dataset_info.json").read_text())[name]
    (folder / entry["file_name"]).write_text(json.dumps(examples), encoding="utf-8")
    info.write_text(json.dumps({name: entry}), encoding="utf-8")
    out = folder / f"{name}.{family}.parquet"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = mask_files(None, out, tokenizer=chat_tokenizer(family), dataset_info=info, dataset=name,
                            keep_dropped=True, max_drop_fraction=1.0)
    table = pq.read_table(out)
    labelled = dict(zip(table.column("peer_row").to_pylist(),
                        zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist())))
    return [labelled.get(i, ([], [])) for i in range(len(examples))], report  # a row lossmask refused trains nothing


def trained(ids, labels):
    return [t for t, label in zip(ids, labels) if label != -100]


CALL_ID = re.compile(r', "id": "[0-9]{9}"')


def explained(tok, theirs: list[int], ours: list[int]) -> bool:
    """Do the two trained texts differ only in the ways docs/inputs.md explains? LLaMA-Factory's own templates train
    the newline its template writes after a stop token (Qwen's ``<|im_end|>\n``), which the model's chat template
    writes outside the turn; and lossmask writes the ids Mistral's template requires of tool calls."""
    stops = {tok.eos_token_id, *tok.special_ids}

    def text(ids: list[int]) -> str:
        kept = [t for i, t in enumerate(ids) if not (i and ids[i - 1] in stops and not tok.decode([t]).strip())]
        return CALL_ID.sub("", tok.decode(kept))

    return text(theirs) == text(ours)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamafactory", required=True, type=Path, help="the unpacked llamafactory source package")
    parser.add_argument("--rows", type=int, default=1000, help="rows of each dataset (default: all of the demos)")
    parser.add_argument("--templates", nargs="+", default=list(TEMPLATES), choices=list(TEMPLATES))
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.llamafactory / "src"))
    sys.meta_path.insert(0, _StandIns())
    from conftest import chat_tokenizer, tokenizer_path

    data = args.llamafactory / "data"
    total = agree = agree_explained = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.datasets:
            for template_name in args.templates:
                family = TEMPLATES[template_name]
                theirs = llamafactory_labels(args.llamafactory, data, name, template_name, tokenizer_path(family),
                                             args.rows)
                ours, report = lossmask_labels(data, name, family, args.rows, Path(tmp))
                tok = chat_tokenizer(family)
                same = sum(trained(*a) == trained(*b) for a, b in zip(theirs, ours))
                known = sum(explained(tok, trained(*a), trained(*b)) for a, b in zip(theirs, ours))
                total += len(theirs)
                agree += same
                agree_explained += known
                print(f"{name:24s} {template_name:8s} ({family:10s}) rows {len(theirs):5d}  same trained tokens "
                      f"{same:5d} ({same / max(len(theirs), 1):.1%})  same but for the explained differences {known:5d} "
                      f"({known / max(len(theirs), 1):.1%})  kept by lossmask {report.rows_out}"
                      + (f" ({', '.join(report.invalid_examples)[:300]})" if report.invalid_examples else ""))
                for (a_ids, a_labels), (b_ids, b_labels) in zip(theirs, ours):
                    a, b = trained(a_ids, a_labels), trained(b_ids, b_labels)
                    if not explained(tok, a, b):
                        print(f"    first difference: LLaMA-Factory trains {tok.decode(a)[-160:]!r}")
                        print(f"                      lossmask trains      {tok.decode(b)[-160:]!r}")
                        break
    print(f"all: {agree} of {total} rows train the same tokens ({agree / max(total, 1):.1%}); {agree_explained} "
          f"({agree_explained / max(total, 1):.1%}) the same but for the explained differences")
    return 0


if __name__ == "__main__":
    sys.exit(main())
