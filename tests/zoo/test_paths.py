"""Zoo references: a drafter exported into a zoo directory records its target by entry name."""

from specula.zoo.paths import sibling_ref


def test_sibling_entries_are_recorded_by_name(tmp_path):
    zoo = tmp_path / "zoo-next"
    (zoo / "target").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    assert sibling_ref(str(zoo / "target"), zoo / "eagle") == "target"
    assert sibling_ref(str(tmp_path / "elsewhere"), zoo / "eagle") == str(tmp_path / "elsewhere")  # not in that zoo
    assert sibling_ref("target", zoo / "eagle") == "target"  # a name stays a name
    assert sibling_ref(str(zoo / "missing"), zoo / "eagle") == str(zoo / "missing")  # not a directory: as given
