import pytest

from tiercache.config import Config, GiB, MiB, from_mapping, load_file, parse_size, with_overrides
from tiercache.errors import ConfigError


@pytest.mark.parametrize("text,expected", [("512MiB", 512 * MiB), ("4GiB", 4 * GiB), ("1.5G", 1_500_000_000),
                                           ("1024", 1024), (77, 77), ("2 mib", 2 * MiB)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12XB", "-1", "MiB", True, -5])
def test_bad_sizes_are_rejected(text):
    with pytest.raises(ConfigError):
        parse_size(text)


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  port: 6000\nhost:\n  capacity_bytes: 256MiB\nredis:\n  url: redis://r:6379\n")
    config = load_file(path)
    assert config.server.port == 6000 and config.host.capacity_bytes == 256 * MiB
    config = with_overrides(config, {"server.port": 7000, "disk.capacity_bytes": "1GiB", "redis.url": None})
    assert config.server.port == 7000 and config.disk.capacity_bytes == GiB and config.redis.url == "redis://r:6379"


@pytest.mark.parametrize("values,needle", [
    ({"server": {"prot": 1}}, "server.prot"),
    ({"sever": {}}, "sever"),
    ({"server": {"port": "abc"}}, "server.port"),
    ({"server": {"port": 70000}}, "server.port"),
    ({"redis": {"url": "http://x"}}, "redis.url"),
    ({"host": {"capacity_bytes": "lots"}}, "host.capacity_bytes: not a size: 'lots'"),
    ({"server": {8080: 1}}, "server.8080"),  # YAML keys need not be strings
])
def test_invalid_config_names_the_key(values, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        from_mapping(values)


def test_a_bad_value_in_a_file_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("disk:\n  capacity_bytes: 100 GB of it\n")
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path}/c\.yaml: disk\.capacity_bytes: not a size: "
                                          r"'100 GB of it' \(use e\.g\. 512MiB"):
        load_file(path)
    path.write_text("server:\n  port: 99999\n")
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path}/c\.yaml: server\.port must be 0\.\.65535"):
        load_file(path)


def test_bad_yaml_is_a_config_error_naming_file_line_and_column(tmp_path):
    # Before: PyYAML's four lines flattened into one, naming the file "<unicode string>" (it parsed a string).
    path = tmp_path / "c.yaml"
    for text, where in (("server: [unclosed", "line 1, column 18: expected ',' or ']', but got '<stream end>' (while "
                                              "parsing a flow sequence that starts at line 1, column 9)"),
                        ("server:\n  port: 1\n host: x\n", "line 3, column 2: expected <block end>, but found "
                                                             "'<block mapping start>' (while parsing a block mapping "
                                                             "that starts at line 1, column 1)"),
                        ("server:\n\tport: 1\n", "line 2, column 1: found character '\\t' that cannot start any "
                                                  "token (while scanning for the next token)")):
        path.write_text(text)
        with pytest.raises(ConfigError) as bad:
            load_file(path)
        assert str(bad.value) == f"config file {path} is not valid YAML: {where}"
    path.write_bytes(b"server:\n  host: \xff\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0xff at offset 16\)$"):
        load_file(path)
    with pytest.raises(ConfigError):
        load_file(tmp_path / "missing.yaml")


def test_defaults_are_valid():
    config = Config()
    assert config.redis.url is None and config.host.capacity_bytes > 0 and config.disk.capacity_bytes > 0


def test_events_are_off_by_default_and_their_keys_are_checked(tmp_path):
    assert not Config().events.enabled
    path = tmp_path / "c.yaml"
    path.write_text("events:\n  enabled: true\n  base_port: 6100\n  flush_interval_s: 0.05\n")
    events = load_file(path).events
    assert events.enabled and events.base_port == 6100 and events.flush_interval_s == 0.05
    for bad, needle in (({"base_port": 80}, "events.base_port"), ({"flush_interval_s": 0}, "flush_interval_s"),
                        ({"heartbeat_s": 0.01}, "heartbeat_s"), ({"encoding": "json"}, "events.encoding"),
                        ({"advertise": "all"}, "events.advertise"), ({"medium_override": "G P U"}, "medium_override")):
        with pytest.raises(ConfigError, match=needle):
            from_mapping({"events": bad})
    chosen = from_mapping({"events": {"encoding": "array", "advertise": "attention", "medium_override": "GPU"}})
    assert (chosen.events.encoding, chosen.events.advertise, chosen.events.medium_override) == \
        ("array", "attention", "GPU")
