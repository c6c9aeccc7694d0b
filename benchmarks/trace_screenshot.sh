#!/usr/bin/env bash
# Screenshots of one turn's trace in Arize Phoenix (see docs/tracing.md), taken headless:
#
#   bash benchmarks/trace_screenshot.sh TRACE_ID [OUT_DIR]      (default OUT_DIR: docs/images)
#
# TRACE_ID is the "trace_id" that benchmarks/trace_demo.py prints. Writes OUT_DIR/trace-phoenix.png
# (the turn's span tree, with the engine's request span selected and its attributes shown) and
# OUT_DIR/trace-phoenix-evictions.png (the conversation's root spans: its turns and the
# kv.swap_out / kv.drop spans of its history, which Phoenix lists but shows no link for).
#
# Needs Phoenix serving at $PHOENIX_URL (default http://127.0.0.1:6006), Playwright for Python
# in $UI_PYTHON (default /tmp/uivenv/bin/python) and a Chromium at $CHROMIUM (default
# /usr/bin/chromium, Debian's `chromium`; Playwright downloads no browser of its own here).
set -euo pipefail
trace_id=${1:?usage: trace_screenshot.sh TRACE_ID [OUT_DIR]}
out=${2:-"$(dirname "$0")/../docs/images"}
mkdir -p "$out"
PHOENIX_URL=${PHOENIX_URL:-http://127.0.0.1:6006} CHROMIUM=${CHROMIUM:-/usr/bin/chromium} \
    "${UI_PYTHON:-/tmp/uivenv/bin/python}" - "$trace_id" "$out" <<'EOF'
import json
import os
import sys
import urllib.parse
import urllib.request

from playwright.sync_api import sync_playwright

trace_id, out = sys.argv[1], sys.argv[2]
phoenix = os.environ["PHOENIX_URL"]


def get(path: str, **query: str) -> dict:
    with urllib.request.urlopen(f"{phoenix}{path}?{urllib.parse.urlencode(query)}") as answer:
        return json.load(answer)


# the engine's request span: the one with the GenAI attributes
request = next(s for s in get("/v1/projects/default/spans", trace_id=trace_id)["data"]
               if "gen_ai.operation.name" in s["attributes"])
project = next(x["id"] for x in get("/v1/projects")["data"] if x["name"] == "default")
conversation = request["attributes"]["gen_ai.conversation.id"]
of_conversation = f'attributes["pensieve"]["conversation_id"] == "{conversation}"'

with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=os.environ["CHROMIUM"], args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1600, "height": 1560})
    page.goto(f"{phoenix}/redirects/spans/{request['context']['span_id']}")
    page.get_by_text("kv.swap_in").first.wait_for()
    page.get_by_role("button", name="Collapse side navigation").click()
    page.get_by_role("tab", name="Attributes").click()
    page.get_by_role("radio", name="JSON").click()
    page.wait_for_timeout(1500)
    page.screenshot(path=f"{out}/trace-phoenix.png")

    page.set_viewport_size({"width": 1600, "height": 700})
    page.goto(f"{phoenix}/projects/{project}/spans?"
              + urllib.parse.urlencode({"spanFilterCondition": of_conversation}))
    page.get_by_text("kv.drop").first.wait_for()
    page.get_by_role("button", name="Hide aside panel").click()
    page.get_by_role("button", name="Columns").click()
    # toggled: the trace id shown, the columns left empty here hidden
    for column in ("traceId", "input_value", "output_value", "error", "userId", "annotations",
                   "tokenCostTotal"):
        page.locator(f"label:has(input[name={column}])").click()
    page.keyboard.press("Escape")
    page.mouse.click(800, 650)  # below the rows: the focus leaves the Columns button
    page.wait_for_timeout(1500)
    page.screenshot(path=f"{out}/trace-phoenix-evictions.png")
    browser.close()
print(f"{out}/trace-phoenix.png {out}/trace-phoenix-evictions.png")
EOF
