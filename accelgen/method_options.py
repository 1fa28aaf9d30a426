"""The one command-line grammar of method options, shared by `generate`, `sot`, `bench` and `serve`:

    name=value                      -o: an option of the one method run or served
    method.name=value               -o: an option of one of the methods run or served (needed where they are several)
    method@name=value+name=value    a benchmark row that runs a method with some options set (a variant)
    a, b@paths=[[0],[1]], c         a list of methods (a comma inside brackets belongs to an option value)

A dash in an option name reads as an underscore (num-assistant-tokens = num_assistant_tokens). Values parse by
the option's declared type: JSON where it gives a value of that type, else text (`workload=2024` is a word).
"""

from __future__ import annotations

from typing import Optional

from accelgen.errors import InputError
from accelgen.registry import option_types, parse_method_option, parse_option_value

# A variant runs a method with some options set as a row of its own, e.g. to sweep a lossy method's
# thresholds in one interleaved run: specdec@beta=2+tau=0.5 (values as JSON where they parse).
VARIANT = "@"
VARIANT_JOIN = "+"


def split_assignment(pair: str, form: str) -> tuple[str, str]:
    """'gamma=8' -> ('gamma', '8'); a ValueError saying the pair must look like `form` when it has no name=."""
    key, sep, value = pair.partition("=")
    if not sep or not key:
        raise InputError(f"method option {pair!r} must look like {form}")
    return key, value


def option_name(key: str) -> str:
    return key.replace("-", "_")


def parse_options(pairs: list[str], defaults: dict) -> dict:
    """['gamma=8', 'gamma_schedule=heuristic'] -> {'gamma': 8, 'gamma_schedule': 'heuristic'}: each value typed by
    its option's default in `defaults` (any JSON value, else text, for an option not there)."""
    options = {}
    for pair in pairs:
        key, value = split_assignment(pair, "name=value")
        name = option_name(key)
        options[name] = parse_option_value(value, option_types(name, defaults[name]) if name in defaults else None)
    return options


def parse_method_options(pairs: list[str], methods: Optional[list[str]] = None) -> dict[str, dict]:
    """['speculative.gamma=8', 'hf-assisted.num_assistant_tokens=5'] -> {'speculative': {'gamma': 8}, ...}; a pair
    naming no method (gamma=8) is an option of the one method of `methods` (its variants count as that method),
    refused where they are several or not known yet."""
    bases = list(dict.fromkeys(base_method(each) for each in methods or ()))
    form = "name=value or method.name=value" if len(bases) == 1 else "method.name=value, e.g. speculative.gamma=8"
    options: dict[str, dict] = {}
    for pair in pairs:
        key, value = split_assignment(pair, form)
        method, dot, name = key.rpartition(".")
        if not dot and len(bases) == 1:
            method = bases[0]
        elif not dot and bases:
            raise InputError(f"method option {pair!r}: several methods run ({', '.join(bases)}); name the one it is "
                             f"for, as method.name=value, e.g. {bases[0]}.{pair}")
        if not method or not name:
            raise InputError(f"method option {pair!r} must look like {form}")
        name = option_name(name)
        options.setdefault(method, {})[name] = parse_method_option(base_method(method), name, value)
    return options


def parse_options_of(method: str, pairs: list[str]) -> dict:
    """The options of the one method run, from name=value and method.name=value pairs alike; a ValueError for
    another method's."""
    options = parse_method_options(pairs, [method])
    others = sorted(set(options) - {base_method(method)})
    if others:
        raise InputError(f"options given for {', '.join(others)}, but the method run is {method}")
    return options.get(base_method(method), {})


def base_method(name: str) -> str:
    """The method a row runs: 'specdec@beta=2' -> 'specdec'."""
    return name.partition(VARIANT)[0]


def parse_variant(name: str) -> tuple[str, dict]:
    """'specdec@beta=2+tau=0.5' -> ('specdec', {'beta': 2, 'tau': 0.5}); a plain name -> (name, {})."""
    base, _, assignments = name.partition(VARIANT)
    values = {}
    for pair in assignments.split(VARIANT_JOIN) if assignments else ():
        try:
            key, value = split_assignment(pair, "name=value")
        except ValueError:
            raise InputError(f"method variant {name!r}: write its options as name=value joined by "
                             f"'{VARIANT_JOIN}', e.g. specdec@beta=2+tau=0.5") from None
        values[option_name(key)] = parse_method_option(base, option_name(key), value)
    return base, values


def split_list(text: Optional[str]) -> Optional[list[str]]:
    """'a, b@x=[1,2], c' -> ['a', 'b@x=[1,2]', 'c']: a comma inside brackets belongs to an option value."""
    if not text:
        return None
    items, current, depth = [], "", 0
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    return [item.strip() for item in items + [current] if item.strip()]
