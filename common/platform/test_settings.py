from dataclasses import FrozenInstanceError, dataclass

import pytest

from common.platform.settings import SettingsError, load_settings, port_check, positive, setting


@dataclass(frozen=True)
class Demo:
    port: int = setting(8000, help="port", check=port_check)
    name: str = setting("x", help="name")
    ratio: float = setting(0.5, help="ratio", check=positive)
    enabled: bool = setting(True, help="flag")
    mode: str = setting("a", help="mode", choices=("a", "b"))
    items: tuple[str, ...] = setting((), help="items")

    def validate(self):
        return "name must not be 'bad'" if self.name == "bad" else None


@dataclass(frozen=True)
class Required:
    path: str = setting(help="required path")


def test_defaults_env_and_flags_precedence():
    s = load_settings(Demo, [], {})
    assert (s.port, s.name, s.ratio, s.enabled, s.mode, s.items) == (8000, "x", 0.5, True, "a", ())
    s = load_settings(Demo, [], {"COSINE_PORT": "9000", "COSINE_ENABLED": "false", "COSINE_ITEMS": "p, q"})
    assert (s.port, s.enabled, s.items) == (9000, False, ("p", "q"))
    s = load_settings(Demo, ["--port", "9100", "--items", "r", "--items", "s,t"], {"COSINE_PORT": "9000"})
    assert s.port == 9100 and s.items == ("r", "s", "t")
    s = load_settings(Demo, ["--no-enabled"], {"COSINE_ENABLED": "1"})
    assert s.enabled is False


def test_settings_are_frozen():
    s = load_settings(Demo, [], {})
    with pytest.raises(FrozenInstanceError):
        s.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "argv,env,needle",
    [
        (["--port", "70000"], {}, "--port: 70000 must be a port number"),
        (["--port", "abc"], {}, "--port: 'abc' is not an integer"),
        ([], {"COSINE_PORT": "-1"}, "COSINE_PORT: -1 must be a port number"),
        (["--ratio", "0"], {}, "--ratio: 0.0 must be greater than 0"),
        (["--mode", "c"], {}, "invalid choice"),
        ([], {"COSINE_MODE": "c"}, "COSINE_MODE: 'c' is not one of a, b"),
        (["--frobnicate"], {}, "unrecognized arguments: --frobnicate"),
        (["--name", "bad"], {}, "name must not be 'bad'"),
        ([], {"COSINE_ENABLED": "maybe"}, "is not true/false"),
    ],
)
def test_bad_values_raise_one_line_errors(argv, env, needle):
    with pytest.raises(SettingsError) as info:
        load_settings(Demo, argv, env)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_required_field():
    with pytest.raises(SettingsError, match="--path .or COSINE_PATH. is required"):
        load_settings(Required, [], {})
    assert load_settings(Required, [], {"COSINE_PATH": "/m"}).path == "/m"
