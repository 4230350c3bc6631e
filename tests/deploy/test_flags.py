"""Flags from config dataclasses: nested configs flatten into one set of flags."""

import argparse
import shlex

import pytest

from deploy.flags import add_config_flags, config_flags, config_from_args, config_overrides
from loadtest.replay import ReplayConfig
from prefix_router.cli import build_parser
from router.config import GatewayConfig


def gateway_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["gateway", *flags])


def test_nested_routing_knobs_take_flat_flags():
    flags = shlex.split("--stride 8 --recompute-weight 2 --policy round_robin --block-size 32")
    config = config_from_args(GatewayConfig, gateway_args(*flags))
    assert config.policy == "round_robin"
    assert config.routing.index.stride == 8 and config.routing.cache_aware.recompute_weight == 2.0
    assert config.routing.block_size == 32 and config.routing.stride_tokens == 256
    assert config.routing.index.mode == "precise"  # set by the policy: no flag


def test_flags_left_out_keep_the_dataclass_defaults():
    assert config_from_args(GatewayConfig, gateway_args()) == GatewayConfig()


def test_gateway_and_replay_share_one_policy_config():
    replay = build_parser().parse_args(["replay", "--stride", "2", "--load-bound", "1.25"])
    config = config_from_args(ReplayConfig, replay)
    gateway = config_from_args(GatewayConfig, gateway_args("--stride", "2", "--load-bound", "1.25"))
    assert config.routing == gateway.routing


def test_config_flags_read_back_as_the_same_overrides():
    routing = {"index": {"stride": 2}, "cache_aware": {"cold_slack_tokens": 64.0}}
    tokenizers = ("qwen=/models/qwen", "phi=/models/phi")  # a repeatable flag
    overrides = {"routing": routing, "max_retries": 0, "model_tokenizer": tokenizers}
    args = gateway_args(*config_flags(overrides))
    assert config_overrides(args, GatewayConfig) == overrides
    assert config_from_args(GatewayConfig, args).named_tokenizers()["phi"] == "/models/phi"


def test_a_bad_value_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="stride"):
        config_from_args(GatewayConfig, gateway_args("--stride", "0"))


def test_two_fields_with_one_flag_are_refused_when_the_parser_is_built():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, GatewayConfig)
    with pytest.raises(argparse.ArgumentError, match="conflicting option string"):
        add_config_flags(parser, ReplayConfig)


def test_a_fields_comment_is_its_flags_help_and_its_default_follows():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, GatewayConfig)
    helps = {action.dest: action.help for action in parser._actions}
    # a nested config's field, documented by its #: comment
    assert helps["block_size"] == (
        "Tokens per KV block of the fleet's engines (the router must hash as they do). "
        "(default: 16)"
    )
    assert helps["policy"] == "default: cache_aware"  # no comment: the default alone
    parser.format_help()  # every help formats (argparse reads a % as a format)
