"""The embedded English -> German corpus from gettext catalogs (the start of the translation issue)."""

import os
import struct

import pytest

from deriv_lm.data.parallel import LOCALE_DIR, Pair, gettext_pairs, split_of, split_pairs


def write_mo(path, messages: dict[str, str]) -> None:
    """A minimal GNU .mo file (the format gettext.GNUTranslations reads): header, then two string tables."""
    keys = sorted(messages)
    ids = b"".join(k.encode() + b"\0" for k in keys)
    strs = b"".join(messages[k].encode() + b"\0" for k in keys)
    n = len(keys)
    start = 7 * 4 + 16 * n
    key_offsets, value_offsets, pos = [], [], 0
    for k in keys:
        key_offsets += [len(k.encode()), start + pos]
        pos += len(k.encode()) + 1
    pos = 0
    for k in keys:
        value_offsets += [len(messages[k].encode()), start + len(ids) + pos]
        pos += len(messages[k].encode()) + 1
    header = struct.pack("Iiiiiii", 0x950412DE, 0, n, 7 * 4, 7 * 4 + 8 * n, 0, 0)
    path.write_bytes(
        header + struct.pack(f"{2 * n}i", *key_offsets) + struct.pack(f"{2 * n}i", *value_offsets) + ids + strs
    )


def test_catalog_entries_are_filtered(tmp_path):
    folder = tmp_path / "de" / "LC_MESSAGES"
    folder.mkdir(parents=True)
    write_mo(
        folder / "a.mo",
        {
            "": "Content-Type: text/plain; charset=UTF-8\n",  # the header
            "Open file": "Datei öffnen",
            "Untranslated": "",
            "Same": "Same",
            "%s: %d": "%s: %d",  # a format string, no words
            "%s (%s)": "%s (%s)",
            "menu\x04Quit": "Beenden",  # a context prefix is dropped
            "cannot read %s": "kann %s nicht lesen",
        },
    )
    write_mo(folder / "b.mo", {"": "Content-Type: text/plain; charset=UTF-8\n", "Open file": "Datei öffnen"})
    pairs = gettext_pairs("de", str(tmp_path))
    assert pairs == [
        Pair("Open file", "Datei öffnen"),
        Pair("Quit", "Beenden"),
        Pair("cannot read %s", "kann %s nicht lesen"),
    ]


def test_missing_catalogs_say_how_to_pass_data(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No gettext catalogs for 'xx'.*--dataset"):
        gettext_pairs("xx", str(tmp_path))


def test_split_is_deterministic_and_keeps_a_source_in_one_split():
    pairs = [Pair(f"message {i}", f"Nachricht {i}") for i in range(2000)]
    pairs += [Pair("message 7", "Meldung 7")]
    parts = split_pairs(pairs)
    assert sum(map(len, parts.values())) == len(pairs)
    assert 10 < len(parts["test"]) < 80 and 10 < len(parts["validation"]) < 80
    assert split_of(Pair("message 7", "Meldung 7")) == split_of(Pair("message 7", "Nachricht 7"))
    assert split_pairs(pairs) == parts


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(LOCALE_DIR, "de", "LC_MESSAGES")),
    reason="this machine has no German gettext catalogs",
)
def test_this_machine_has_tens_of_thousands_of_real_pairs():
    pairs = gettext_pairs("de")
    assert len(pairs) > 10_000
    assert len(set(pairs)) == len(pairs) and pairs == sorted(pairs, key=lambda p: (p.source, p.target))
    assert all(p.source and p.target and p.source != p.target for p in pairs)
