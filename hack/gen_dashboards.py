"""Grafana dashboards for reload health, built with grafana-foundation-sdk (Grafana 11, a
development dependency: the operator never imports this).

The generated JSON is committed under monitoring/dashboards/ and copied into the chart
(charts/refit-operator/files/dashboards/); `make generate` (hack/generate.py) writes both, and
tests/unit/test_generated.py fails when either differs from what `rendered()` builds.
Every query uses only metrics from refit_operator.edges.metrics (and Prometheus' own `up`).
"""

from __future__ import annotations

import json
from typing import Any, Final

from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders.common import (
    GraphThresholdsStyleConfig,
    ReduceDataOptions,
    StackingConfig,
    VizLegendOptions,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dash
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueTextMode,
    GraphDrawStyle,
    GraphThresholdsStyleMode,
    LegendDisplayMode,
    LegendPlacement,
    StackingMode,
    VizOrientation,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

DATASOURCE: Final = dash.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every refit-scoped query filters on the two template variables.
SEL: Final = 'namespace=~"$namespace", fleet=~"$fleet"'
OPERATOR_JOB: Final = 'job=~".*refit-operator.*"'
UID: Final = "refit-reload-health"
# The RefitOutOfTrafficSlow alert's bound on the p95 time out of traffic (monitoring/alerts.yaml).
OUT_OF_TRAFFIC_ALERT_SECONDS: Final = 300


def _query(
    expr: str, legend: str, ref: str = "A", *, instant: bool = False
) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)
    return q.instant() if instant else q.range()


def _threshold_override(ref: str) -> dict[str, Any]:
    """Draws query `ref` as a red dashed line: the refit's threshold from its spec."""
    return {
        "ref": ref,
        "properties": [
            dash.DynamicConfigValue("color", {"mode": "fixed", "fixedColor": "red"}),
            dash.DynamicConfigValue("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
            dash.DynamicConfigValue("custom.lineWidth", 2),
            dash.DynamicConfigValue("custom.fillOpacity", 0),
        ],
    }


def _series(title: str, description: str, unit: str, *queries: prometheus.Dataquery) -> Any:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(12)
        .height(8)
        .line_width(2)
        .fill_opacity(0)
        .legend(
            VizLegendOptions()
            .show_legend(True)
            .display_mode(LegendDisplayMode.TABLE)
            .placement(LegendPlacement.RIGHT)
            .calcs(["lastNotNull", "max"])
        )
    )
    for q in queries:
        panel = panel.with_target(q)
    return panel


def _probe_panel(title: str, description: str, value_expr: str, threshold: str) -> Any:
    """Per-pod probe values (one series per pod) with the refit's threshold as a dashed line."""
    panel = _series(
        title,
        description,
        "none",
        _query(value_expr, "{{pod}}"),
        _query(f"max by (refit) ({threshold}{{{SEL}}})", "threshold ({{refit}})", "B"),
    )
    override = _threshold_override("B")
    return panel.min(0).override_by_query(override["ref"], override["properties"])


def _stat(title: str, description: str, expr: str, *, red_from: float | None = 1) -> Any:
    steps = [dash.Threshold(value=None, color="green")]
    if red_from is not None:
        steps.append(dash.Threshold(value=red_from, color="red"))
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(_query(expr, "", instant=True))
        .span(4)
        .height(4)
        .color_mode(BigValueColorMode.BACKGROUND)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(dashboard.ThresholdsConfig().mode(dash.ThresholdsMode.ABSOLUTE).steps(steps))
    )


def _bars(title: str, description: str, unit: str, expr: str, legend: str) -> Any:
    return (
        bargauge.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(_query(expr, legend, instant=True))
        .unit(unit)
        .span(8)
        .height(8)
        .orientation(VizOrientation.HORIZONTAL)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def _out_of_traffic_panels() -> tuple[Any, Any]:
    """The headline figure: how long refits keep a pod out of traffic, per fleet, over the
    dashboard's range (p50 and p95) and over time (as the RefitOutOfTrafficSlow alert sees it:
    a 30-minute window, its 300 s bound drawn as a red line)."""
    ranged = (
        "histogram_quantile({q}, sum by (fleet, le) (increase("
        f"refit_pod_out_of_traffic_seconds_bucket{{{{{SEL}}}}}[$__range])))"
    )
    sliding = (
        "histogram_quantile({q}, sum by (fleet, le) (rate("
        f"refit_pod_out_of_traffic_seconds_bucket{{{{{SEL}}}}}[30m])))"
    )
    # Red from the RefitOutOfTrafficSlow alert's bound on the p95.
    alert_line = (
        dashboard.ThresholdsConfig()
        .mode(dash.ThresholdsMode.ABSOLUTE)
        .steps(
            [
                dash.Threshold(value=None, color="green"),
                dash.Threshold(value=OUT_OF_TRAFFIC_ALERT_SECONDS, color="red"),
            ]
        )
    )
    bars = (
        bargauge.Panel()
        .title("Time out of traffic p50 / p95")
        .description(
            "Seconds refit passes kept a pod out of traffic (weights-ready condition False to "
            "True), per fleet, over the pods put back into traffic in the dashboard's time "
            "range. The exact worst pod of a refit: `kubectl refit status NAME`."
        )
        .datasource(DATASOURCE)
        .with_target(_query(ranged.format(q="0.5"), "p50 {{fleet}}", instant=True))
        .with_target(_query(ranged.format(q="0.95"), "p95 {{fleet}}", "B", instant=True))
        .unit("s")
        .min(0)
        .span(12)
        .height(8)
        .orientation(VizOrientation.HORIZONTAL)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(alert_line)
    )
    series = (
        _series(
            "Time out of traffic over time",
            "p50 and p95 seconds out of traffic per fleet over the last 30 minutes of pods put "
            "back into traffic, as the RefitOutOfTrafficSlow alert computes it (red line: its "
            "300 s bound on the p95).",
            "s",
            _query(sliding.format(q="0.95"), "p95 {{fleet}}"),
            _query(sliding.format(q="0.5"), "p50 {{fleet}}", "B"),
        )
        .min(0)
        .thresholds(alert_line)
        .thresholds_style(GraphThresholdsStyleConfig().mode(GraphThresholdsStyleMode.LINE))
    )
    return bars, series


def reload_health() -> dash.Dashboard:
    """Refit / Reload health: probes, steps, refit outcomes, fleet state, operator health."""
    step_q = "histogram_quantile({q}, sum by (step, le) (increase(refit_step_duration_seconds_bucket{{{sel}}}[$__range])))"  # noqa: E501
    out_of_traffic_bars, out_of_traffic_series = _out_of_traffic_panels()
    builder = (
        dashboard.Dashboard("Refit / Reload health")
        .uid(UID)
        .description(
            "Weight refits of vLLM fleets: per-pod probe results against the checkpoint's "
            "reference, step timings, refit outcomes, fleet version skew and operator health."
        )
        .tags(["refit", "vllm", "rl"])
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .tooltip(dash.DashboardCursorSync.CROSSHAIR)
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(
            dashboard.QueryVariable("namespace")
            .label("Namespace")
            .datasource(DATASOURCE)
            .query("label_values(refit_fleet_target_version_info, namespace)")
            .refresh(dash.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dash.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
        )
        .with_variable(
            dashboard.QueryVariable("fleet")
            .label("Fleet")
            .datasource(DATASOURCE)
            .query('label_values(refit_fleet_target_version_info{namespace=~"$namespace"}, fleet)')
            .refresh(dash.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dash.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
        )
        .with_row(dashboard.Row("Fleet"))
        .with_panel(
            stat.Panel()
            .title("Target version")
            .description("The fleet's target weight version and the refit that sets it.")
            .datasource(DATASOURCE)
            .with_target(
                _query(
                    f"refit_fleet_target_version_info{{{SEL}}}",
                    "{{fleet}}: {{version}} ({{refit}})",
                    instant=True,
                )
            )
            .span(6)
            .height(4)
            .text_mode(BigValueTextMode.NAME)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .color_mode(BigValueColorMode.NONE)
        )
        .with_panel(
            _stat(
                "Pods out of traffic",
                "Fleet pods whose weights-ready readiness condition is False.",
                f"sum(refit_fleet_pods_out_of_traffic{{{SEL}}})",
            ).span(6)
        )
        .with_panel(
            _stat(
                "Version skew",
                "Fleet pods not at the fleet's target version.",
                f"sum(refit_fleet_version_skew{{{SEL}}})",
            ).span(6)
        )
        .with_panel(
            _stat(
                "Failed probes (range)",
                "Probe verdicts 'fail' in the dashboard's time range.",
                f'sum(increase(refit_probe_verdicts_total{{{SEL}, result="fail"}}[$__range]))',
            ).span(6)
        )
        .with_panel(
            _series(
                "Pods by refit phase",
                "Pods of each fleet's current refit by per-pod phase.",
                "none",
                _query(f"sum by (phase) (refit_pods{{{SEL}}})", "{{phase}}"),
            )
            .stacking(StackingConfig().mode(StackingMode.NORMAL))
            .fill_opacity(30)
        )
        .with_panel(
            _series(
                "Version skew and pods out of traffic",
                "Per fleet: pods not at the target version, and pods kept out of traffic.",
                "none",
                _query(f"sum by (fleet) (refit_fleet_version_skew{{{SEL}}})", "skew {{fleet}}"),
                _query(
                    f"sum by (fleet) (refit_fleet_pods_out_of_traffic{{{SEL}}})",
                    "out of traffic {{fleet}}",
                    "B",
                ),
            ).min(0)
        )
        .with_panel(out_of_traffic_bars)
        .with_panel(out_of_traffic_series)
        .with_row(dashboard.Row("Probes"))
        .with_panel(
            _probe_panel(
                "|Δlogprob| mean per pod",
                "Mean over probe tokens of |logprob_pod - logprob_reference| (nats), with the "
                "refit's meanAbsLogprobDiff threshold.",
                f"refit_probe_logprob_abs_diff_mean_nats{{{SEL}}}",
                "refit_probe_threshold_logprob_abs_diff_mean_nats",
            )
        )
        .with_panel(
            _probe_panel(
                "|Δlogprob| max per pod",
                "Largest single-token |logprob_pod - logprob_reference| (nats), with the "
                "refit's maxAbsLogprobDiff threshold.",
                f"refit_probe_logprob_abs_diff_max_nats{{{SEL}}}",
                "refit_probe_threshold_logprob_abs_diff_max_nats",
            )
        )
        .with_panel(
            _series(
                "Probe NLL per pod",
                "Mean NLL per token of the probe prompts on each pod, and the reference NLL.",
                "none",
                _query(f"refit_probe_nll_nats{{{SEL}}}", "{{pod}}"),
                _query(
                    f"max by (refit) (refit_probe_reference_nll_nats{{{SEL}}})",
                    "reference ({{refit}})",
                    "B",
                ),
            ).override_by_query(
                "B",
                [
                    dash.DynamicConfigValue("color", {"mode": "fixed", "fixedColor": "blue"}),
                    dash.DynamicConfigValue("custom.lineStyle", {"fill": "dash", "dash": [4, 4]}),
                ],
            )
        )
        .with_panel(
            _probe_panel(
                "|NLL - reference NLL| per pod",
                "Absolute NLL difference to the reference (nats), with the refit's nllDiff "
                "threshold.",
                f"abs(refit_probe_nll_nats{{{SEL}}} - refit_probe_reference_nll_nats{{{SEL}}})",
                "refit_probe_threshold_nll_diff_nats",
            )
        )
        .with_panel(
            _series(
                "Probe verdicts",
                "Probe verdicts given, by result.",
                "none",
                _query(
                    f"sum by (result) (increase(refit_probe_verdicts_total{{{SEL}}}"
                    "[$__rate_interval]))",
                    "{{result}}",
                ),
            )
            .draw_style(GraphDrawStyle.BARS)
            .fill_opacity(80)
            .stacking(StackingConfig().mode(StackingMode.NORMAL))
            .override_by_name(
                "fail", [dash.DynamicConfigValue("color", {"mode": "fixed", "fixedColor": "red"})]
            )
            .override_by_name(
                "pass",
                [dash.DynamicConfigValue("color", {"mode": "fixed", "fixedColor": "green"})],
            )
            .override_by_name(
                "inconclusive",
                [dash.DynamicConfigValue("color", {"mode": "fixed", "fixedColor": "orange"})],
            )
        )
        .with_panel(
            table.Panel()
            .title("Current verdict per pod")
            .description("The latest probe verdict of every pod of the current refits.")
            .datasource(DATASOURCE)
            .with_target(
                _query(f"refit_probe_verdict{{{SEL}}} == 1", "", instant=True).format(
                    PromQueryFormat.TABLE
                )
            )
            .span(12)
            .height(8)
        )
        .with_row(dashboard.Row("Steps and refits"))
        .with_panel(
            _bars(
                "Step duration p50",
                "Median duration of each per-pod step over the dashboard's time range.",
                "s",
                step_q.format(q="0.5", sel=SEL),
                "{{step}}",
            )
        )
        .with_panel(
            _bars(
                "Step duration p95",
                "95th percentile duration of each per-pod step over the time range.",
                "s",
                step_q.format(q="0.95", sel=SEL),
                "{{step}}",
            )
        )
        .with_panel(
            _bars(
                "Refit outcomes",
                "Refits that ended in the time range, by result.",
                "none",
                f"sum by (result) (increase(refit_refits_total{{{SEL}}}[$__range]))",
                "{{result}}",
            )
        )
        .with_panel(
            _series(
                "Step p95 over time",
                "95th percentile step duration per step, over a sliding window.",
                "s",
                _query(
                    "histogram_quantile(0.95, sum by (step, le) (rate("
                    f"refit_step_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                    "{{step}}",
                ),
            )
        )
        .with_panel(
            _series(
                "Step failures",
                "Per-pod step attempts that failed or timed out.",
                "none",
                _query(
                    "sum by (step, result) (increase(refit_step_duration_seconds_count{"
                    f'{SEL}, result!="success"}}[$__rate_interval]))',
                    "{{step}} {{result}}",
                ),
            ).draw_style(GraphDrawStyle.BARS)
        )
        .with_row(dashboard.Row("Operator"))
        .with_panel(
            _stat(
                "Operator up",
                "Whether Prometheus scrapes the operator's metrics endpoint.",
                f"min({OPERATOR_JOB.join(('up{', '}'))})",
                red_from=None,
            )
            .thresholds(
                dashboard.ThresholdsConfig()
                .mode(dash.ThresholdsMode.ABSOLUTE)
                .steps(
                    [
                        dash.Threshold(value=None, color="red"),
                        dash.Threshold(value=1, color="green"),
                    ]
                )
            )
            .span(6)
        )
        .with_panel(
            _stat(
                "Since last reconcile",
                "Seconds since the operator's last successful reconcile pass.",
                "time() - max(refit_operator_last_successful_reconcile_timestamp_seconds)",
                red_from=600,
            )
            .unit("s")
            .span(6)
        )
        .with_panel(
            _series(
                "Active refits: elapsed vs timeout",
                "Time each active refit has run, against its totalTimeoutSeconds.",
                "s",
                _query(
                    f"time() - refit_active_refit_start_time_seconds{{{SEL}}}",
                    "elapsed {{refit}}",
                ),
                _query(f"refit_active_refit_timeout_seconds{{{SEL}}}", "timeout {{refit}}", "B"),
            ).override_by_query("B", _threshold_override("B")["properties"])
        )
        .with_panel(
            _series(
                "Reconciles, errors and API retries",
                "Operator reconcile passes, reconcile errors by kind, API retries by verb (/s).",
                "ops",
                _query(
                    "sum(rate(refit_operator_reconciles_total[$__rate_interval]))", "reconciles"
                ),
                _query(
                    "sum by (kind) (rate(refit_operator_reconcile_errors_total[$__rate_interval]))",
                    "errors {{kind}}",
                    "B",
                ),
                _query(
                    "sum by (verb) (rate(refit_operator_api_retries_total[$__rate_interval]))",
                    "retries {{verb}}",
                    "C",
                ),
            )
        )
    )
    built: dash.Dashboard = builder.build()
    # Grafana keys panel state (links, edits, repeats) by id; the SDK leaves every id at 0.
    for number, panel in enumerate(built.panels or [], start=1):
        panel.id_val = number
    return built


# File name under monitoring/dashboards/ -> dashboard builder.
DASHBOARDS: Final = {"reload-health.json": reload_health}


def render(board: dash.Dashboard) -> str:
    """Stable JSON (sorted keys, trailing newline) so regenerating is a no-op when unchanged."""
    encoded = JSONEncoder(sort_keys=True, indent=2, ensure_ascii=False).encode(board)
    return json.dumps(json.loads(encoded), sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def rendered() -> dict[str, str]:
    return {name: render(build()) for name, build in DASHBOARDS.items()}
