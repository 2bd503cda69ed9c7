"""Zoo references: a drafter exported into a zoo directory records its target by entry name."""

from specula.zoo.store import TARGET_DIR, resolve_ref, sibling_ref


def test_sibling_entries_are_recorded_by_name(tmp_path):
    zoo = tmp_path / "zoo-next"
    (zoo / "target").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    assert sibling_ref(str(zoo / "target"), zoo / "eagle") == "target"
    assert sibling_ref(str(tmp_path / "elsewhere"), zoo / "eagle") == str(tmp_path / "elsewhere")  # not in that zoo
    assert sibling_ref("target", zoo / "eagle") == "target"  # a name stays a name
    assert sibling_ref(str(zoo / "missing"), zoo / "eagle") == str(zoo / "missing")  # not a directory: as given


def test_a_record_names_the_entry_beside_it(tmp_path):
    """A candidate zoo's drafter records ``"target": "target"``: that is the candidate target beside it, not the
    shipped one (read when a FLASH / EAGLE head loads its embedding without a target in the process)."""
    zoo = tmp_path / "candidates"
    (zoo / "target").mkdir(parents=True)
    (zoo / "flash").mkdir()
    assert resolve_ref("target", zoo / "flash") == zoo / "target"
    assert resolve_ref(str(tmp_path), zoo / "flash") == tmp_path  # a path stays that path
    if TARGET_DIR.is_dir():  # no entry of that name beside it: the shipped zoo's
        assert resolve_ref("target", tmp_path / "elsewhere" / "flash") == TARGET_DIR
