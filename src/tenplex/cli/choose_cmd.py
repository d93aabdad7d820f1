"""`tenplex choose`: rank the (dp, tp, pp) layouts of a model on N devices by estimated step time."""

from __future__ import annotations

import argparse
import json

from ..ptc import PTCError
from ..ptc.layout import Layout
from ..util import print_table
from ..util.flags import size
from .args import MODEL_HELP, add_snapshot_args, model_spec, snapshot

TIED = "the reference workload runs tied embeddings with tp = pp = 1"


def choose_cmd(args: argparse.Namespace) -> int:
    from ..ptc import ModelSpec
    from ..runtime.chooser import parse_table, rank_layouts
    from ..runtime.tables import read_table

    if bool(args.model) == bool(args.job):
        raise PTCError(
            "choose needs --model (a preset or your model's file) or --job (a snapshot), one of them"
        )
    if args.job:
        label, ptc = snapshot(args)
        spec = ModelSpec.from_ptc(ptc)
    else:
        label, spec = model_spec(args.model)
    ranked = rank_layouts(spec, args.devices, args.global_batch, args.micro_batch, args.device_memory)
    table = parse_table(read_table(args.para_config, "para-config")) if args.para_config else {}
    choice = _choice(ranked, table, args.devices, args.model)
    if args.json:
        print(json.dumps({"model": label, "choice": choice, "ranking": [e.to_json() for e in ranked]}))
        return 0
    if not ranked:
        raise PTCError(
            f"no layout of {label} fits {args.devices} devices with global batch {args.global_batch}"
        )
    rows = [[str(i + 1), f"dp={e.layout.dp},tp={e.layout.tp},pp={e.layout.pp}", f"{e.seconds:.3f} s",
             f"{e.memory / 2**20:.1f} MiB"] for i, e in enumerate(ranked)]  # fmt: skip
    title = f"{label} on {args.devices} devices, global batch {args.global_batch}: estimated step time"
    print_table(title, ["#", "layout", "step", "memory/device"], rows)
    if not spec.hidden or not spec.seq:
        print("without the model's hidden size and sequence length the estimate leaves activations out")
    if not spec.tp_known:
        print("tp=1 only: a snapshot does not say how its tensors split over tp (--model FILE does)")
    if args.devices in table:
        lay = table[args.devices]
        print(f"para-config overrides: dp={lay.dp},tp={lay.tp},pp={lay.pp}")
    elif choice is None:
        print(f"tenplex run takes none of these: {TIED}")
    elif Layout(choice["dp"], choice["tp"], choice["pp"]) != ranked[0].layout:
        print(f"tenplex run takes dp={choice['dp']},tp={choice['tp']},pp={choice['pp']}: {TIED}")
    return 0


def _choice(ranked: list, table: dict, devices: int, model: str | None) -> dict | None:
    """What `tenplex run` would pick: the para-config's entry, else the best layout the reference workload
    runs for a preset (the ranking also lists layouts only the architecture allows), else the best."""
    from ..ptc import PRESETS

    if devices in table:
        lay = table[devices]
        return {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "from": "para-config"}
    runs = [e for e in ranked if model not in PRESETS or e.layout.allowed(PRESETS[model], devices)]
    return {**runs[0].to_json(), "from": "cost model"} if runs else None


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("choose", help="rank the (dp, tp, pp) layouts of a model on N devices")
    c.add_argument("--model", help=MODEL_HELP)
    c.add_argument("--devices", type=int, required=True, help="devices the job runs on")
    c.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step (dp divides it)")
    c.add_argument("--micro-batch", type=int, default=0, help="samples per micro-batch (0: one per dp rank)")
    c.add_argument("--device-memory", type=size, help="e.g. 80GiB: drop layouts that do not fit")
    c.add_argument("--para-config", help="JSON or YAML table: devices -> {dp, tp, pp}, overrides the ranking")
    c.add_argument("--json", action="store_true", help="print one JSON object: the choice and the ranking")
    add_snapshot_args(c, "rank the layouts of")
    c.set_defaults(func=choose_cmd)
