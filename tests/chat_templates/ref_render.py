#!/usr/bin/python3
"""The reference: renders chat templates exactly as transformers does.

transformers' _compile_jinja_template: jinja2's ImmutableSandboxedEnvironment with
trim_blocks=True, lstrip_blocks=True and the loopcontrols extension (its AssistantTracker
extension adds {% generation %}, which renders its body), tojson as json.dumps with
ensure_ascii=False, raise_exception and strftime_now. Reads JSON lines {"template", "variables",
"now"} on stdin and writes {"output"} or {"error", "kind"} per line.
"""
import json
import sys
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2 import nodes


class AssistantTracker(Extension):
    # transformers' extension, reduced to what rendering does: the body is rendered as it is
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class Raised(Exception):
    pass


def compile_template(source, now):
    def raise_exception(message):
        raise Raised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        moment = datetime.fromtimestamp(now) if now is not None else datetime.now()
        return moment.strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def main():
    for line in sys.stdin:
        case = json.loads(line)
        try:
            template = compile_template(case["template"], case.get("now"))
            result = {"output": template.render(**case["variables"])}
        except Raised as e:
            result = {"error": str(e), "kind": "raised"}
        except jinja2.TemplateSyntaxError as e:
            result = {"error": str(e), "kind": "syntax"}
        except Exception as e:  # what the template does wrong at render time
            result = {"error": "%s: %s" % (type(e).__name__, e), "kind": "render"}
        sys.stdout.write(json.dumps(result, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
