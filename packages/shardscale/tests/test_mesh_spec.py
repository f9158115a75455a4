"""The one mesh grammar (``_mesh_spec``) and the shared argparse helper (``_cmdline``)."""

from __future__ import annotations

import argparse

import pytest

from shardscale.cli._cmdline import (
    CommandParser,
    add_command,
    bounded_float,
    command_error,
    mesh_arg,
    parse_command_line,
)
from shardscale.cli._mesh_spec import MeshSpecError, parse_mesh_list, parse_mesh_spec


@pytest.mark.parametrize(
    ("text", "dims"),
    [
        ("4", (("dp", 4),)),
        ("2x2", (("dp", 2), ("tp", 2))),
        ("dp4", (("dp", 4),)),
        ("pp2xdp2", (("pp", 2), ("dp", 2))),
        ("PP2 x DP2", (("pp", 2), ("dp", 2))),
        ("dp2xtp2xpp2", (("dp", 2), ("tp", 2), ("pp", 2))),
        ("ep4xdp2", (("ep", 4), ("dp", 2))),
        ("1", (("dp", 1),)),
    ],
)
def test_grammar_accepts(text: str, dims: tuple[tuple[str, int], ...]) -> None:
    spec = parse_mesh_spec(text)
    assert spec.dims == dims
    assert spec.size == int(__import__("math").prod(s for _, s in dims))
    # The canonical spelling parses back to the same mesh.
    assert parse_mesh_spec(str(spec)) == spec


def test_get_defaults_to_one_and_refuses_unknown_names() -> None:
    spec = parse_mesh_spec("pp2xdp3")
    assert (spec.get("pp"), spec.get("dp"), spec.get("tp"), spec.get("ep")) == (2, 3, 1, 1)
    assert spec.sizes == (2, 3) and spec.names == ("pp", "dp")
    with pytest.raises(KeyError, match="not a mesh dimension"):
        spec.get("xx")


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("", "empty"),
        ("pp2,dp2", "not a list"),
        ("2x", "missing"),
        ("x2", "missing"),
        ("2x2x2", "3 bare sizes"),
        ("2xtp2", "'2' has no name"),
        ("dp2xdp2", "'dp' is written twice"),
        ("dp0", "'dp0' has size 0"),
        ("dp", "'dp' has no size"),
        ("dpa", "'a' is not a whole number"),
        ("zz2", "'zz2' is not a dimension"),
        ("1d", "'1d' is not a dimension"),
        ("dp2xfoo", "'foo' is not a dimension"),
    ],
)
def test_grammar_refuses_naming_the_part(text: str, names: str) -> None:
    with pytest.raises(MeshSpecError) as info:
        parse_mesh_spec(text)
    message = str(info.value)
    assert names in message
    assert message.startswith(f"--mesh {text!r}")
    assert "a bare N is dpN" in message  # the grammar is shown


def test_mesh_list() -> None:
    meshes = parse_mesh_list("4, 2x2 ,pp2xdp2")
    assert [str(m) for m in meshes] == ["dp4", "dp2xtp2", "pp2xdp2"]
    for bad, names in [("4,,2", "empty mesh"), ("", "no mesh"), ("4,2x", "missing")]:
        with pytest.raises(MeshSpecError, match=names):
            parse_mesh_list(bad)


def _parser() -> argparse.ArgumentParser:
    top = CommandParser(prog="shardscale")
    sub = top.add_subparsers(dest="command", parser_class=CommandParser)
    p = add_command(sub, "demo", help="h", description="d")
    p.add_argument("--mesh", type=mesh_arg)
    p.add_argument("--limit", type=bounded_float(0.5, 10, unit="seconds", example="--limit 2"))
    return top


def test_unknown_option_uses_the_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_command_line(_parser(), ["demo", "--nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shardscale demo")
    assert "shardscale demo: error: unrecognized arguments: --nope" in err


def test_bad_values_name_the_range_and_the_grammar(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, expect in [
        (["demo", "--limit", "1e10"], "from 0.5 to 10, got '1e10'; e.g. --limit 2"),
        (["demo", "--limit", "nan"], "from 0.5 to 10"),
        (["demo", "--mesh", "pp2,dp2"], "not a list"),
    ]:
        with pytest.raises(SystemExit) as info:
            parse_command_line(_parser(), argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "shardscale demo: error: argument" in err and expect in err, err
    args = parse_command_line(_parser(), ["demo", "--mesh", "2x2", "--limit", "10"])
    assert str(args.mesh) == "dp2xtp2" and args.limit == 10.0


def test_command_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_command_line(_parser(), ["demo"])
    assert command_error(args, "the mesh does not fit") == 2
    assert capsys.readouterr().err == "shardscale demo: error: the mesh does not fit\n"
    assert command_error("shardscale bench", "x") == 2
