"""Shape groups of a calibration or validation .npz: key `NAME` is the unlabelled group, keys `NAME@LABEL` group LABEL.

Within a group every input's array shares the sample dim (dim 0); groups may differ in the open dims, so a
model with a variable image size or sequence length is checked and calibrated on real data at several sizes.
Shared by the config check (supervisor) and the loader (worker); no numpy here, only the keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

#: The unlabelled group: keys that are an input's name exactly (every .npz from before groups).
PLAIN = ""
SEPARATOR = "@"


class GroupError(ValueError):
    """The file's keys do not form whole groups; the message names the group and the input."""


def group_name(label: str) -> str:
    """How a group is called in messages: `group 'small'`, or `the unlabelled group` for plain keys."""
    return "the unlabelled group" if label == PLAIN else f"group {label!r}"


def sample_groups(keys: Iterable[str], inputs: Sequence[str]) -> dict[str, dict[str, str]]:
    """label -> input name -> the file's key, in the order the file first names each group (unlabelled first).

    A key that is neither an input's name nor `input@label` is not ours and is left alone, as before groups.
    Raises GroupError when a group lacks an input, or when no key names an input at all.
    """
    keys, names = list(keys), set(inputs)
    groups: dict[str, dict[str, str]] = {}
    for key in keys:
        if key in names:
            groups.setdefault(PLAIN, {})[key] = key
            continue
        name, separator, label = key.rpartition(SEPARATOR)
        if separator and label and name in names:
            groups.setdefault(label, {})[name] = key
    if not groups:
        raise GroupError(f"lacks arrays for inputs {list(inputs)}; it has {sorted(keys)}")
    for label, members in groups.items():
        missing = [name for name in inputs if name not in members]
        if missing:
            raise GroupError(
                f"{group_name(label)} has no array for input {missing[0]!r} (key {_key(missing[0], label)!r})"
            )
    return dict(sorted(groups.items(), key=lambda item: item[0] != PLAIN))


def _key(name: str, label: str) -> str:
    return name if label == PLAIN else f"{name}{SEPARATOR}{label}"


def round_robin(counts: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """(group, sample) pairs taken one from each group in turn, at most `limit`: every group is represented."""
    taken: list[tuple[int, int]] = []
    for index in range(max(counts, default=0)):
        for group, count in enumerate(counts):
            if index < count and len(taken) < limit:
                taken.append((group, index))
    return taken


#: A validation file's key `seq:NAME` (or `seq:NAME@LABEL`, one set of sequences per label) holds sequences of
#: input NAME, shaped [steps, streams, *one sample's dims]: the sequence gate feeds them step by step to a stateful
#: model (its state inputs have no key: every stream starts from the declared initial state).
SEQUENCE_PREFIX = "seq:"


def sequence_groups(keys: Iterable[str], inputs: Sequence[str]) -> dict[str, dict[str, str]]:
    """label -> input name -> the file's key, over the `seq:` keys only ({} when the file holds no sequence).

    Raises GroupError when a set of sequences lacks one of `inputs` (the model's inputs other than its state).
    """
    stripped = {key[len(SEQUENCE_PREFIX) :]: key for key in keys if key.startswith(SEQUENCE_PREFIX)}
    if not stripped:
        return {}
    try:
        groups = sample_groups(stripped, inputs)
    except GroupError as exc:
        raise GroupError(f"sequences ({SEQUENCE_PREFIX}* keys): {exc}") from exc
    return {label: {name: stripped[key] for name, key in members.items()} for label, members in groups.items()}


def holds_samples(keys: Iterable[str]) -> bool:
    """Whether the file has any key besides sequences (a file of sequences alone holds no single sample)."""
    return any(not key.startswith(SEQUENCE_PREFIX) for key in keys)
