"""deploy.helm_render: the Go-template subset behaves as Helm does, and refuses what it lacks."""

from pathlib import Path

import pytest

from deploy.helm_render import Engine, TemplateError, main, merge_values, parse_set


CHART = str(Path(__file__).resolve().parents[1] / "k8s")


def render(text, values=None, partials=""):
    engine = Engine({"_helpers.tpl": partials, "t.yaml": text})
    return engine.render("t.yaml", {"Values": values or {}, "Release": {"Name": "r"}})


def test_trimming_pipelines_and_functions():
    assert render("a: {{- .Values.x | quote }}\n", {"x": 5}) == 'a:"5"\n'
    assert render("{{ .Values.missing }}|{{ default \"d\" .Values.missing }}|{{ default \"d\" .Values.x }}", {"x": "v"}) == "|d|v"
    assert render('{{ printf "%s-%d" .Release.Name 3 }}') == "r-3"
    assert render("k:{{ .Values.m | toYaml | nindent 2 }}", {"m": {"b": 1, "a": [1]}}) == "k:\n  a:\n  - 1\n  b: 1"
    assert render("{{ (.Values.m).b }} {{ (dict \"a\" 1).a }}", {"m": {"b": 2}}) == "2 1"
    assert render("{{ .Values.b }} {{ .Values.f }} {{ .Values.n }}", {"b": True, "f": 0.5, "n": 3.0}) == "true 0.5 3"
    assert render("{{/* comment */ -}}\n  x") == "x"


def test_control_structures_and_variables():
    text = "{{- range $i, $v := .Values.l }}{{ if $i }},{{ end }}{{ $v }}{{ end }}"
    assert render(text, {"l": ["a", "b"]}) == "a,b"
    assert render("{{ range $k, $v := .Values.m }}{{ $k }}={{ $v }};{{ end }}", {"m": {"b": 2, "a": 1}}) == "a=1;b=2;"
    assert render("{{ range .Values.l }}x{{ else }}none{{ end }}", {"l": []}) == "none"
    assert render("{{ if eq .Values.a 1 }}one{{ else if eq .Values.a 2 }}two{{ else }}many{{ end }}", {"a": 2}) == "two"
    assert render("{{ with .Values.m }}{{ .k }}{{ else }}-{{ end }}", {"m": {"k": "v"}}) == "v"
    assert render("{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ end }}{{ $x }}") == "2"
    assert render("{{ and 1 0 }} {{ or 0 \"\" \"z\" }} {{ not .Values.e }}", {"e": []}) == "0 z true"


def test_define_and_include_get_their_own_dot():
    partials = '{{- define "p" -}}{{ .root.Release.Name }}-{{ .c }}{{- end }}'
    assert render('{{ include "p" (dict "root" $ "c" "x") | upper }}', partials=partials) == "R-X"
    assert render('{{ template "p" (dict "root" . "c" "y") }}', partials=partials) == "r-y"


def test_errors_are_explicit():
    with pytest.raises(TemplateError, match="needed"):
        render('{{ required "needed" .Values.x }}')
    with pytest.raises(TemplateError, match="not in the supported subset"):
        render("{{ sha256sum .Values.x }}")
    with pytest.raises(TemplateError, match="nil pointer"):
        render("{{ .Values.a.b }}")
    with pytest.raises(TemplateError, match="use toYaml"):
        render("{{ .Values.m }}", {"m": {"a": 1}})
    with pytest.raises(TemplateError, match="without end"):
        render("{{ if .Values.x }}")


def test_values_merge_like_helm():
    base = {"a": {"b": 1, "c": 2}, "l": [1, 2], "d": 1}
    assert merge_values(base, {"a": {"b": 3}, "l": [9], "d": None}) == {"a": {"b": 3, "c": 2}, "l": [9]}
    assert parse_set("x.y=3") == {"x": {"y": 3}} and parse_set("x=false") == {"x": False}


def test_cli_renders_the_chart(capsys):
    assert main([CHART, "--set", "redis.password=s3cret"]) == 0
    out = capsys.readouterr().out
    assert "kind: Deployment" in out and "redis://:s3cret@cosine-redis:6379/0" in out
    assert main([CHART, "--set", "redis.enabled=false"]) == 1
