"""What `dflash-shards info` and `verify` print for people (`--json` prints the dicts themselves)."""

from __future__ import annotations

from typing import Any

from dflash.shards.sizes import CacheSize, size_text

_HASH_SHOWN = 12  # hex digits of a digest shown; --json has all of them


def _codec_text(codec: dict[str, Any]) -> str:
    name = codec.get("name", "?")
    options = ", ".join(f"{k} {v}" for k, v in codec.items() if k != "name")
    return f"{name} ({options})" if options else str(name)


def dataset_text(dataset: dict[str, Any]) -> list[str]:
    """The manifest's dataset fingerprint as lines: form, rows, columns, files, short digests. The Arrow
    schema is left to --json (it is the columns' types, spelled over several lines)."""
    head = [str(dataset["form"])] if "form" in dataset else []
    if "rows" in dataset:
        head.append(f"{dataset['rows']:,} rows")
    columns = dataset.get("columns")
    if isinstance(columns, dict):
        named = [k if k == v else f"{k}={v}" for k, v in columns.items()]
        head.append("columns " + ", ".join(named))
    files = dataset.get("files")
    if isinstance(files, list):
        total = sum(f.get("bytes", 0) for f in files if isinstance(f, dict))
        head.append(f"{len(files)} file{'s' if len(files) != 1 else ''}, {size_text(total)}")
    lines = [", ".join(head)] if head else []
    digests = [
        f"{key} {str(value)[:_HASH_SHOWN]}"
        for key, value in dataset.items()
        if key.endswith(("sha256", "xxh3")) and isinstance(value, str)
    ]
    if digests:
        lines.append(", ".join(digests))
    known = {"form", "rows", "columns", "files", "schema"}
    lines += [
        f"{key} {value}"
        for key, value in dataset.items()
        if key not in known and not key.endswith(("sha256", "xxh3"))
    ]
    return lines or ["(not recorded)"]


def info_text(d: dict[str, Any]) -> str:
    """`dflash-shards info` for people: one labelled line per fact, sizes by `sizes.CacheSize`."""
    size = CacheSize(stored_bytes=d["bytes"], raw_bytes=d["raw_bytes"], dtype=d["raw_dtype"])
    per_token = f", {d['bytes_per_token']:,.0f} B/token" if d["bytes_per_token"] else ""
    t = d["target"]
    dataset = dataset_text(d["dataset"])
    lines = [
        f"cache       {d['path']} ({'complete' if d['complete'] else 'INCOMPLETE'})",
        f"samples     {d['samples']:,} ({d['skipped']:,} skipped) in {d['shards']:,} shards",
        f"tokens      {d['tokens']:,} ({d['supervised']:,} supervised)",
        f"size        {size.text()}{per_token}",
        f"layers      {', '.join(map(str, d['layers']))} ({len(d['layers'])} x hidden {d['hidden_size']}, "
        f"{d['dtype']})",
        f"codec       {_codec_text(d['codec'])}",
        f"target      {t.get('name_or_path')} ({t.get('model_type')}, {t.get('num_hidden_layers')} layers)",
        f"dataset     {dataset[0]}",
        *(f"            {line}" for line in dataset[1:]),
    ]
    return "\n".join(lines)


def verify_text(d: dict[str, Any], problems: list[str]) -> str:
    """`dflash-shards verify` for people: the verdict, what was checked, what the dataset check
    accounted for (with --dataset), then one line per problem."""
    lines = [
        f"{'OK' if d['ok'] else 'FAILED'}: {d['shards_checked']} shards, {d['samples_checked']} samples, "
        f"{d['frames_checked']} frames, {size_text(d['bytes_checked'])} checked"
        + (" (hashes only)" if d["quick"] else f", {size_text(d['decoded_bytes'])} decoded")
    ]
    ds = d.get("dataset")
    if ds:
        line = (
            f"dataset: {ds['rows']:,} rows accounted for: {ds['stored']:,} stored once, {ds['skipped']:,} "
            f"listed as skipped, {ds['missing']:,} missing"
        )
        checked = ds["fingerprint_checked"]
        if checked:
            one = len(checked) == 1
            if ds["fingerprint_matches"]:
                verdict = "matches" if one else "match"
            else:
                verdict = "does NOT match" if one else "do NOT all match"
            line += f"; {', '.join(checked)} {verdict} the manifest's"
        else:
            line += "; the manifest records no fingerprint to compare rows, lengths and tokens with"
        lines.append(line)
    lines += [f"  {p}" for p in problems]
    return "\n".join(lines)
