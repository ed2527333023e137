/* dsv4-drift report: draws the page from the JSON payload embedded in the script element #report-data.
 *
 * No dependencies and no network: charts are hand-written SVG (line charts) and canvas (heatmap).
 * Every string that came from a user (scenario, prompt, variant and patch names, gate/attribution
 * fields) reaches the page through textContent or setAttribute, never through innerHTML.
 */
(function () {
  'use strict';
  var started = performance.now();

  // ------------------------------------------------------------------------------------------
  // data
  // ------------------------------------------------------------------------------------------
  var NONFINITE = new Map([['__nan__', NaN], ['__inf__', Infinity], ['__-inf__', -Infinity]]);
  var D = JSON.parse(document.getElementById('report-data').textContent, function (k, v) {
    return typeof v === 'string' && NONFINITE.has(v) ? NONFINITE.get(v) : v;
  });
  var M = D.manifest || {};
  var LAYERS = D.layers || [];
  var NL = LAYERS.length;
  var YARD = 'yardstick';
  var VARIANTS = D.variants || [];
  var OPT = VARIANTS.filter(function (v) { return v !== YARD; });
  var MODES = D.modes && D.modes.length ? D.modes : ['global'];
  var BINS = D.bins || {};
  var NB = (BINS.pos_bin || []).length;
  var PHASES = ['prefill', 'decode'].filter(function (p) { return (BINS.phase || []).indexOf(p) >= 0; });
  if (!PHASES.length) PHASES = ['prefill', 'decode'];
  var errors = [];
  window.__reportErrors = errors;

  var PALETTE = ['#3b6fb6', '#e8702a', '#2e9d5b', '#c0392b', '#8e5cc2', '#8c6d31', '#d45ba6', '#17a2b8',
    '#6b7a1d', '#5b5b9f', '#b8860b', '#1b7f79'];
  var REF_COLOR = '#111111';
  var YARD_COLOR = '#7a8494';
  function colorOf(variant) {
    if (variant === YARD) return YARD_COLOR;
    var i = OPT.indexOf(variant);
    return PALETTE[(i < 0 ? 0 : i) % PALETTE.length];
  }
  var KIND_COLOR = { swa: '#9ecae1', csa: '#a1d99b', hca: '#fdc38d' };

  function get(obj) {
    for (var i = 1; i < arguments.length; i++) {
      if (obj === null || obj === undefined || typeof obj !== 'object') return undefined;
      obj = obj[arguments[i]];
    }
    return obj;
  }
  function isNum(v) { return typeof v === 'number' && !Number.isNaN(v); }
  function finite(v) { return typeof v === 'number' && Number.isFinite(v); }

  function info(key) {
    var m = (D.metrics || {})[key];
    if (m) return m;
    var metric = String(key).split('@')[0];
    return { family: metric.split('.')[0], label: metric, better: 'lower', scale: 'log', metric: metric, tap: null };
  }
  function labelOf(key) {
    var m = info(key);
    return m.tap ? m.label + ' · ' + m.tap : m.label;
  }
  /** The metric as an error (0 = perfect), as in report_data.badness. */
  function badness(key, v) {
    if (!isNum(v)) return null;
    var m = info(key);
    if (m.better === 'lower') return /(\.bias|_delta)$/.test(m.metric) ? Math.abs(v) : v;
    if (m.better === 'higher') return 1 - v;
    if (m.better === 'sqnr') return Math.pow(10, -v / 20);
    return null;
  }
  function series(mode, variant, key, phase, agg) {
    return get(D.table, mode, variant, key, phase, agg || 'mean') || null;
  }
  function yardMode(mode) { return get(D.table, mode, YARD) ? mode : 'global'; }

  // ------------------------------------------------------------------------------------------
  // formatting and DOM
  // ------------------------------------------------------------------------------------------
  function fmt(v) {
    if (v === null || v === undefined) return '–';
    if (typeof v !== 'number') return String(v);
    if (Number.isNaN(v)) return 'NaN';
    if (!Number.isFinite(v)) return v > 0 ? '+inf' : '-inf';
    if (v === 0) return '0';
    if (Number.isInteger(v) && Math.abs(v) < 1e9) return String(v);  // counts, positions, sizes: exact
    var a = Math.abs(v);
    if (a >= 1e5 || a < 1e-3) return v.toExponential(2).replace('e+', 'e');
    var p = 3;
    while (p < 8 && v !== 1 && Math.abs(parseFloat(v.toPrecision(p))) === 1) p++;  // 0.99996 is not 1
    return String(parseFloat(v.toPrecision(p)));
  }
  function fmtRatio(r) {
    if (!isNum(r)) return '–';
    if (!Number.isFinite(r)) return '∞×';
    return (r >= 100 ? r.toFixed(0) : r >= 10 ? r.toFixed(1) : r.toFixed(2)) + '×';
  }
  function plain(v) {
    // any JSON value as a short readable string (gate/attribution fields of unknown shape)
    if (v === null || v === undefined) return '–';
    if (typeof v === 'number') return fmt(v);
    if (typeof v === 'string') return v;
    if (typeof v === 'boolean') return v ? 'yes' : 'no';
    if (Array.isArray(v)) return v.map(plain).join(', ');
    return Object.keys(v).map(function (k) { return k + '=' + plain(v[k]); }).join(', ');
  }

  function h(tag, attrs) {
    var e = document.createElement(tag);
    if (attrs) {
      Object.keys(attrs).forEach(function (k) {
        var v = attrs[k];
        if (v === null || v === undefined || v === false) return;
        if (k === 'class') e.className = v;
        else if (k === 'text') e.textContent = String(v);
        else if (k === 'style') Object.assign(e.style, v);
        else if (k.slice(0, 2) === 'on') e.addEventListener(k.slice(2), v);
        else e.setAttribute(k, v === true ? '' : String(v));
      });
    }
    for (var i = 2; i < arguments.length; i++) append(e, arguments[i]);
    return e;
  }
  function append(parent, child) {
    if (child === null || child === undefined || child === false) return;
    if (Array.isArray(child)) { child.forEach(function (c) { append(parent, c); }); return; }
    parent.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); return e; }

  var SVGNS = (function () { var d = document.createElement('div'); d.innerHTML = '<svg></svg>'; return d.firstChild.namespaceURI; })();
  function s(tag, attrs, text) {
    var e = document.createElementNS(SVGNS, tag);
    Object.keys(attrs || {}).forEach(function (k) { if (attrs[k] !== null && attrs[k] !== undefined) e.setAttribute(k, String(attrs[k])); });
    if (text !== undefined) e.textContent = String(text);
    return e;
  }

  function selectBox(label, options, value, onchange) {
    var sel = h('select', { onchange: function () { onchange(sel.value); } });
    options.forEach(function (o) {
      var opt = typeof o === 'object' ? o : { value: o, label: o };
      sel.appendChild(h('option', { value: opt.value, text: opt.label, selected: String(opt.value) === String(value) }));
    });
    return h('label', null, label, sel);
  }
  function checkBox(label, checked, onchange) {
    var box = h('input', { type: 'checkbox', checked: checked, onchange: function () { onchange(box.checked); } });
    return h('label', null, box, label);
  }
  function kindChip(layer) {
    var l = LAYERS[layer];
    if (!l) return h('span', { class: 'chip', text: layer === NL ? 'logits' : '?' });
    var chips = [h('span', { class: 'chip ' + l.kind, text: String(l.kind).toUpperCase() })];
    if (l.hash) chips.push(' ', h('span', { class: 'chip hash', text: 'hash', title: 'hash-routed MoE layer' }));
    return h('span', null, chips);
  }
  function layerRef(layer) {
    if (layer === null || layer === undefined) return h('span', { class: 'empty', text: 'never' });
    if (typeof layer !== 'number') return h('span', { text: plain(layer) });
    return h('span', null, (layer === NL ? 'logits' : 'L' + layer) + ' ', layer < NL ? kindChip(layer) : null);
  }
  function kv(pairs) {
    var dl = h('dl', { class: 'kv' });
    pairs.forEach(function (p) {
      if (p[1] === undefined) return;
      dl.appendChild(h('dt', { text: p[0] }));
      dl.appendChild(h('dd', null, p[1] instanceof Node ? p[1] : plain(p[1])));
    });
    return dl;
  }
  function objectTable(rows, preferred) {
    // a table for a list of objects of unknown shape (gate findings, attribution ranking, …)
    if (!Array.isArray(rows) || !rows.length) return h('p', { class: 'empty', text: 'none' });
    var cols = (preferred || []).slice();
    rows.forEach(function (r) {
      if (r && typeof r === 'object' && !Array.isArray(r)) Object.keys(r).forEach(function (k) { if (cols.indexOf(k) < 0) cols.push(k); });
    });
    if (!cols.length) cols = ['value'];
    var t = h('table', { class: 'data' });
    t.appendChild(h('thead', null, h('tr', null, cols.map(function (c) { return h('th', { class: 'left', text: c }); }))));
    var tb = h('tbody');
    rows.forEach(function (r) {
      var obj = r && typeof r === 'object' && !Array.isArray(r) ? r : { value: r };
      tb.appendChild(h('tr', null, cols.map(function (c) {
        var v = obj[c];
        return h('td', { class: 'left' }, (c === 'layer' || c === 'first_layer' || c === 'first_failing_layer') && typeof v === 'number' ? layerRef(v) : plain(v));
      })));
    });
    t.appendChild(tb);
    return h('div', { class: 'table-wrap', style: { maxHeight: '360px' } }, t);
  }

  // ------------------------------------------------------------------------------------------
  // gate bounds and colours
  // ------------------------------------------------------------------------------------------
  var GATE = D.gate && typeof D.gate === 'object' ? D.gate : null;
  var CHECKS = GATE && Array.isArray(GATE.rows) ? GATE.rows.filter(function (c) { return c && typeof c === 'object'; }) : [];
  function wild(x) { return x === null || x === undefined || x === '*' || x === 'any' || x === 'both'; }
  function flatCheckFor(key, variant, phase) {
    var metric = info(key).metric;
    for (var i = 0; i < CHECKS.length; i++) {
      var c = CHECKS[i];
      if (c.metric !== key && c.metric !== metric) continue;
      if (!wild(c.variant) && c.variant !== variant) continue;
      if (!wild(c.phase) && c.phase !== phase) continue;
      if (boundValue(c.bound, 0) === null && !Array.isArray(c.bound)) continue;
      return c;
    }
    return null;
  }
  function boundValue(bound, layer) {
    if (isNum(bound)) return bound;
    if (Array.isArray(bound)) return isNum(bound[layer]) ? bound[layer] : null;
    if (bound && typeof bound === 'object') {
      var keys = ['value', 'absolute', 'bound', 'limit'];
      for (var i = 0; i < keys.length; i++) if (isNum(bound[keys[i]])) return bound[keys[i]];
    }
    return null;
  }
  /** The one rule for what the gate did not judge (stated in the page's notes and legend). */
  var UNCHECKED_RULE = 'Colours are the gate’s own verdict: its check’s loss (aggregated as the check says) over the limit it was held to. A value the gate did not judge — no check for that metric, variant, mode, phase or layer, or no gate.json — is not coloured.';
  /**
   * How close a value is to its gate limit (> 1: beyond it), from gate.json only: at that layer, the most
   * binding check's loss over its limit (a flat gate.json: the check's numeric bound). null: not judged, not
   * coloured (UNCHECKED_RULE).
   */
  function limitRatio(key, variant, phase, layer, value, mode) {
    if (variant === YARD) return null;
    var cell = get(GATE, 'cells', key, variant, mode, phase);
    if (cell && cell.ratio && cell.ratio[layer] !== null && cell.ratio[layer] !== undefined) return cellVerdict(cell, layer, phase, mode);
    var b = badness(key, value);
    var check = flatCheckFor(key, variant, phase);
    var bound = check ? boundValue(check.bound, layer) : null;
    if (b === null || bound === null) return null;
    var lb = badness(key, bound);
    if (lb === null) return null;
    return { r: lb > 0 ? b / lb : (b > 0 ? Infinity : 0), source: 'bound', bound: bound, check: check.check };
  }
  /** A gate cell's verdict at one layer: the most binding unit's check, loss and limit, and where in the layer it
   * sits when the check has a group scope (a chunk, turn, decode step or bin: gate.json's unit). */
  function cellVerdict(cell, layer, phase, mode) {
    var check = get(GATE, 'check_names', cell.check[layer]);
    var g = get(cell, 'where', String(layer));
    var scope = get(GATE, 'check_info', check, 'scope');
    return { r: cell.ratio[layer], source: 'gate', check: check, loss: cell.value[layer], limit: cell.limit[layer], mode: mode,
      where: g ? groupText(scope, g[0], [g[1], g[2]], phase) : null };
  }
  function gateTitle(lr) {
    if (!lr) return 'not judged by the gate: not coloured';
    if (lr.source === 'bound') return 'gate bound ' + fmt(lr.bound) + ' (' + fmtRatio(lr.r) + ' of the bound)';
    return 'gate check ' + plain(lr.check) + (lr.where ? ' at ' + lr.where + ' (' + plain(lr.mode) + ')' : '') + ': loss ' + fmt(lr.loss) + ' vs limit ' + fmt(lr.limit) + ' (' + fmtRatio(lr.r) + ' of its limit: ' + (lr.r > 1 || Number.isNaN(lr.r) ? 'fails' : 'passes') + ')';
  }
  /**
   * Where a gate unit sits inside its layer, in words: the phase and, for a group scope, the group —
   * `prefill chunk 1`, `decode step 3`, `prefill turn 2`, `prefill bin [500, 628)` (positions [first, end)). The
   * decode rows are one group of a chunk scope, the prefill rows one of a step scope (index −1).
   */
  function groupText(scope, group, span, phase) {
    var ph = phase ? String(phase) : '';
    if (group === null || group === undefined || !scope || scope === 'layer') return ph;
    if (scope === 'chunk') return group < 0 ? 'decode (all steps)' : 'prefill chunk ' + group;
    if (scope === 'step') return group < 0 ? 'prefill (all positions)' : 'decode step ' + group;
    if (scope === 'turn') return (ph ? ph + ' ' : '') + (group < 0 ? 'preamble (turn −1)' : 'turn ' + group);
    if (scope === 'bin' && Array.isArray(span)) return (ph ? ph + ' ' : '') + 'bin [' + span[0] + ', ' + span[1] + ')';
    return (ph ? ph + ' ' : '') + scope + ' ' + plain(group);
  }
  /** A gate unit's place (layer aside): `prefill chunk 1 · local`; `prefix` reads the row fields first_… or worst_…. */
  function unitWhere(u, prefix) {
    prefix = prefix || '';
    return groupText(u[prefix + 'scope'], u[prefix + 'group'], u[prefix + 'span'], u[prefix + 'phase'] !== undefined ? u[prefix + 'phase'] : u.phase) +
      (u[prefix + 'mode'] ? ' · ' + u[prefix + 'mode'] : '');
  }
  function ratioClass(r) {
    if (!isNum(r)) return r !== null && Number.isNaN(r) ? 'c-bad3' : '';
    if (r <= 0.5) return 'c-good';
    if (r <= 1) return 'c-warn';
    if (r <= 2.5) return 'c-bad';
    if (r <= 6) return 'c-bad2';
    return 'c-bad3';
  }

  // colour maps (interpolated stops)
  var SEQ = ['#ffffd9', '#fff3b0', '#fed976', '#feb24c', '#fd8d3c', '#fc4e2a', '#e31a1c', '#bd0026', '#67001f'];
  var DIV = ['#2166ac', '#4393c3', '#92c5de', '#d1e5f0', '#f7f7f7', '#fddbc7', '#f4a582', '#d6604d', '#b2182b'];
  var DEPTH = ['#440154', '#482878', '#3e4989', '#31688e', '#26828e', '#1f9e89', '#35b779', '#6ece58', '#b5de2b', '#fde725'];
  function hexRgb(c) { return [parseInt(c.slice(1, 3), 16), parseInt(c.slice(3, 5), 16), parseInt(c.slice(5, 7), 16)]; }
  var MAPS = new Map();
  function ramp(stops, t) {
    if (!MAPS.has(stops)) MAPS.set(stops, stops.map(hexRgb));
    var rgb = MAPS.get(stops);
    t = Math.max(0, Math.min(1, isNum(t) ? t : 0));
    var x = t * (rgb.length - 1), i = Math.min(Math.floor(x), rgb.length - 2), f = x - i;
    var c = rgb[i].map(function (a, j) { return Math.round(a + (rgb[i + 1][j] - a) * f); });
    return 'rgb(' + c[0] + ',' + c[1] + ',' + c[2] + ')';
  }

  // ------------------------------------------------------------------------------------------
  // scales and the SVG line chart
  // ------------------------------------------------------------------------------------------
  function niceStep(raw) {
    var p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
  }
  function tickLabel(v) {
    if (v === 0) return '0';
    var a = Math.abs(v);
    if (a >= 1e4 || a < 1e-2) {
      var e = Math.floor(Math.log10(a) + 1e-9), m = parseFloat((v / Math.pow(10, e)).toPrecision(2));
      return (m === 1 ? '' : m === -1 ? '-' : m + '') + (Math.abs(m) === 1 ? '1e' : 'e') + e;
    }
    return String(parseFloat(v.toPrecision(3)));
  }
  function makeScale(values, kind, upperOne) {
    var vals = values.filter(finite);
    if (kind === 'log') {
      var pos = vals.filter(function (v) { return v > 0; });
      if (pos.length) {
        var lo = Math.floor(Math.log10(Math.min.apply(null, pos)));
        var hi = Math.ceil(Math.log10(Math.max.apply(null, pos)));
        if (hi <= lo) hi = lo + 1;
        var ticks = [];
        for (var e = lo; e <= hi; e++) {
          ticks.push({ v: Math.pow(10, e), label: tickLabel(Math.pow(10, e)) });
          if (hi - lo <= 2 && e < hi) [2, 5].forEach(function (m) { ticks.push({ v: m * Math.pow(10, e), label: tickLabel(m * Math.pow(10, e)) }); });
        }
        return {
          f: function (v) { return v > 0 && Number.isFinite(v) ? (Math.log10(v) - lo) / (hi - lo) : null; },
          ticks: ticks, log: true,
        };
      }
    }
    var a = Math.min.apply(null, vals), b = Math.max.apply(null, vals);
    if (upperOne && b <= 1 && b > 1 - 1e-9) b = 1;
    var span = b - a;
    if (!(span > 0) && upperOne && b === 1) { a = 0.9; b = 1.01; }
    else if (!(span > 0)) { span = Math.abs(a) || 1; a -= span * 0.5; b += span * 0.5; } else { a -= span * 0.06; b += span * (upperOne && b === 1 ? 0.02 : 0.06); }
    var step = niceStep((b - a) / 4), t = [];
    for (var x = Math.ceil(a / step) * step; x <= b + step * 1e-9; x += step) t.push({ v: x, label: tickLabel(Math.abs(x) < step * 1e-9 ? 0 : x) });
    return { f: function (v) { return Number.isFinite(v) ? (v - a) / (b - a) : null; }, ticks: t, log: false };
  }

  var tooltipEl = null;
  function tooltip() {
    if (!tooltipEl) { tooltipEl = h('div', { class: 'tooltip' }); tooltipEl.style.display = 'none'; document.body.appendChild(tooltipEl); }
    return tooltipEl;
  }
  function showTooltip(ev, title, rows) {
    var t = clear(tooltip());
    t.appendChild(h('div', { class: 't', text: title }));
    rows.forEach(function (r) {
      t.appendChild(h('div', null, r.color ? h('span', { class: 'sw', style: { background: r.color } }) : null, r.name, h('span', { class: 'v', text: r.value })));
    });
    t.style.display = 'block';
    var x = ev.pageX + 14, y = ev.pageY + 12;
    var w = t.offsetWidth, hh = t.offsetHeight;
    if (x + w > window.scrollX + document.documentElement.clientWidth - 8) x = ev.pageX - w - 14;
    if (y + hh > window.scrollY + window.innerHeight - 8) y = ev.pageY - hh - 12;
    t.style.left = x + 'px';
    t.style.top = y + 'px';
  }
  function hideTooltip() { if (tooltipEl) tooltipEl.style.display = 'none'; }

  /**
   * o: {n (x slots), series: [{name, color, dash, width, values, tooltip:false}], scale: 'log'|'linear',
   *     upperOne, xTicks: [{at, label}], xLabel(i), kinds (per-slot layer kinds), vlines: [{at, color, dash}],
   *     title, height, tooltipSort: 'asc'|'desc', tooltipMax}
   */
  function lineChart(o) {
    var W = o.width || 520, H = o.height || 200;
    var m = { l: 46, r: 8, t: 8, b: o.kinds ? 30 : 22 };
    var pw = W - m.l - m.r, ph = H - m.t - m.b, n = Math.max(o.n, 1), cw = pw / n;
    var X = function (i) { return m.l + (i + 0.5) * cw; };
    var wrap = h('div', { class: 'chart' + (o.wide ? ' wide' : '') });
    if (o.title) wrap.appendChild(h('div', { class: 'ctitle', text: o.title }));
    var vis = o.series.filter(function (se) { return se.values && !se.hidden; });
    var all = [];
    vis.forEach(function (se) { se.values.forEach(function (v) { if (finite(v)) all.push(v); }); });
    if (o.scale === 'log' && !all.some(function (v) { return v > 0; })) all = all.length ? all : [];
    if (!all.length) { wrap.appendChild(h('div', { class: 'empty', style: { padding: '40px 0', textAlign: 'center' }, text: 'not measured' })); return wrap; }
    var sc = makeScale(all, o.scale, o.upperOne);
    var Y = function (v) { var f = sc.f(v); return f === null ? null : m.t + ph * (1 - f); };
    var svg = s('svg', { viewBox: '0 0 ' + W + ' ' + H, preserveAspectRatio: 'xMidYMid meet' });
    sc.ticks.forEach(function (t) {
      var y = Y(t.v);
      if (y === null || y < m.t - 0.5 || y > m.t + ph + 0.5) return;
      svg.appendChild(s('line', { x1: m.l, x2: W - m.r, y1: y, y2: y, class: 'grid' }));
      svg.appendChild(s('text', { x: m.l - 4, y: y + 3, 'text-anchor': 'end' }, t.label));
    });
    (o.vlines || []).forEach(function (vl) {
      var x = m.l + vl.at * cw;
      svg.appendChild(s('line', { x1: x, x2: x, y1: m.t, y2: m.t + ph, stroke: vl.color || '#999', 'stroke-width': vl.width || 1, 'stroke-dasharray': vl.dash || null }));
    });
    svg.appendChild(s('line', { x1: m.l, x2: W - m.r, y1: m.t + ph, y2: m.t + ph, class: 'axis' }));
    svg.appendChild(s('line', { x1: m.l, x2: m.l, y1: m.t, y2: m.t + ph, class: 'axis' }));
    (o.xTicks || []).forEach(function (t) {
      var x = X(t.at);
      svg.appendChild(s('line', { x1: x, x2: x, y1: m.t + ph, y2: m.t + ph + 3, class: 'axis' }));
      svg.appendChild(s('text', { x: x, y: m.t + ph + 12, 'text-anchor': 'middle' }, t.label));
    });
    if (o.kinds) {
      o.kinds.forEach(function (k, i) {
        if (!k) return;
        svg.appendChild(s('rect', { x: m.l + i * cw + 0.3, y: H - 10, width: Math.max(cw - 0.6, 0.6), height: 6, fill: KIND_COLOR[k.kind] || '#ccc' }));
        if (k.hash) svg.appendChild(s('circle', { cx: X(i), cy: H - 7, r: Math.min(1.8, cw / 3), fill: '#6a3d9a' }));
      });
    }
    vis.forEach(function (se) {
      var d = '', pts = [];
      se.values.forEach(function (v, i) {
        if (!finite(v)) return;
        var y = Y(v);
        if (y === null) return;
        d += (d ? 'L' : 'M') + X(i).toFixed(1) + ' ' + y.toFixed(1);
        pts.push([X(i), y]);
      });
      if (!d) return;
      svg.appendChild(s('path', { d: d, fill: 'none', stroke: se.color, 'stroke-width': se.width || 1.6, 'stroke-dasharray': se.dash || null, 'stroke-linejoin': 'round', opacity: se.opacity || null }));
      if (se.markers !== false && pts.length <= 64 && !se.dash) {
        pts.forEach(function (p) { svg.appendChild(s('circle', { cx: p[0].toFixed(1), cy: p[1].toFixed(1), r: se.width && se.width < 1.2 ? 1.2 : 2, fill: se.color })); });
      }
      // NaN / inf points: a red mark at the top edge
      se.values.forEach(function (v, i) {
        if (typeof v === 'number' && !Number.isFinite(v)) svg.appendChild(s('text', { x: X(i), y: m.t + 8, 'text-anchor': 'middle', fill: '#b42318', style: 'fill:#b42318;font-weight:700' }, Number.isNaN(v) ? 'NaN' : '∞'));
      });
    });
    var guide = s('line', { x1: 0, x2: 0, y1: m.t, y2: m.t + ph, class: 'guide', visibility: 'hidden' });
    svg.appendChild(guide);
    var hit = s('rect', { x: m.l, y: m.t, width: pw, height: ph, fill: 'transparent' });
    svg.appendChild(hit);
    hit.addEventListener('mousemove', function (ev) {
      var rect = svg.getBoundingClientRect();
      var sx = (ev.clientX - rect.left) * W / rect.width;
      var i = Math.max(0, Math.min(n - 1, Math.floor((sx - m.l) / cw)));
      guide.setAttribute('x1', X(i)); guide.setAttribute('x2', X(i)); guide.setAttribute('visibility', 'visible');
      var rows = vis.filter(function (se) { return se.tooltip !== false && se.values[i] !== null && se.values[i] !== undefined; })
        .map(function (se) { return { name: se.name, color: se.color, raw: se.values[i], value: fmt(se.values[i]) }; });
      if (o.tooltipSort) rows.sort(function (a, b) { return o.tooltipSort === 'asc' ? a.raw - b.raw : b.raw - a.raw; });
      var extra = (o.tooltipExtra ? o.tooltipExtra(i) : []);
      rows = extra.concat(rows.slice(0, o.tooltipMax || 14));
      showTooltip(ev, o.xLabel ? o.xLabel(i) : String(i), rows);
    });
    hit.addEventListener('mouseleave', function () { guide.setAttribute('visibility', 'hidden'); hideTooltip(); });
    wrap.appendChild(svg);
    return wrap;
  }

  function layerAxis() {
    var step = NL <= 12 ? 1 : NL <= 30 ? 2 : 5, ticks = [];
    for (var i = 0; i < NL; i += step) ticks.push({ at: i, label: String(i) });
    return {
      n: NL, xTicks: ticks, kinds: LAYERS,
      xLabel: function (i) { var l = LAYERS[i]; return 'layer ' + i + (l ? ' · ' + String(l.kind).toUpperCase() + (l.hash ? ' · hash' : '') : ''); },
    };
  }
  function binAxis() {
    var ticks = [], every = Math.max(1, Math.ceil(NB / 8));
    for (var c = 0; c < NB; c += every) ticks.push({ at: c, label: String(BINS.pos_bin[c]) });
    return { n: NB, xTicks: ticks, vlines: binBoundaries(), xLabel: binLabel };
  }
  function binLabel(c) {
    var ph = BINS.phase[c];
    var where = ph === 'decode' ? 'decode step ' + BINS.step[c] : 'prefill chunk ' + BINS.chunk[c];
    return 'tokens ' + BINS.pos_bin[c] + '–' + (BINS.pos_end[c] - 1) + ' · ' + where + ' · turn ' + BINS.turn[c];
  }
  /** The group of a check's scope that bin c belongs to (harness.gate.evaluate.SCOPE_COLUMN). */
  function binGroup(scope, c) {
    return scope === 'chunk' ? BINS.chunk[c] : scope === 'turn' ? BINS.turn[c] : scope === 'step' ? BINS.step[c] : BINS.pos_bin[c];
  }
  function binBoundaries() {
    var out = [];
    for (var c = 1; c < NB; c++) {
      if (BINS.phase[c] !== BINS.phase[c - 1]) out.push({ at: c, kind: 'decode', color: '#1d2330', width: 2 });
      else if (BINS.phase[c] === 'prefill' && BINS.chunk[c] !== BINS.chunk[c - 1]) out.push({ at: c, kind: 'chunk', color: '#1d2330', width: 1 });
      if (BINS.turn[c] !== BINS.turn[c - 1]) out.push({ at: c, kind: 'turn', color: '#d9480f', width: 1.2, dash: '4 3' });
    }
    return out;
  }

  function legend(items, onToggle) {
    var box = h('div', { class: 'legend' });
    items.forEach(function (it) {
      var line = h('span', { class: 'line' + (it.dash ? ' dash' : '') + (it.dot ? ' dot' : ''), style: { borderTopColor: it.color } });
      var el = h('span', { class: 'item' + (it.off ? ' off' : ''), title: it.title || (onToggle && it.toggle !== false ? 'click to show or hide' : null) }, line, it.name);
      if (onToggle && it.toggle !== false) el.addEventListener('click', function () { onToggle(it.key); });
      box.appendChild(el);
    });
    return box;
  }

  function kindLegend() {
    var box = h('div', { class: 'legend' }, 'layer kind (strip under each x axis): ');
    [['swa', 'SWA (sliding window)'], ['csa', 'CSA (compressed sparse, indexer)'], ['hca', 'HCA (heavily compressed)']].forEach(function (k) {
      if (LAYERS.some(function (l) { return l.kind === k[0]; })) box.appendChild(h('span', null, h('span', { class: 'sw', style: { background: KIND_COLOR[k[0]] } }), k[1]));
    });
    if (LAYERS.some(function (l) { return l.hash; })) box.appendChild(h('span', null, h('span', { class: 'sw', style: { background: '#6a3d9a', borderRadius: '50%', width: '7px', height: '7px' } }), 'hash-routed MoE'));
    return box;
  }
  var hidden = new Set();  // variants hidden in every chart (legend toggles)
  var redrawers = [];
  function toggleVariant(v) { if (hidden.has(v)) hidden.delete(v); else hidden.add(v); redrawers.forEach(function (f) { f(); }); }
  function variantLegend(extra) {
    var items = VARIANTS.map(function (v) { return { key: v, name: v, color: colorOf(v), dash: v === YARD, off: hidden.has(v) }; });
    return legend((extra || []).concat(items), toggleVariant);
  }

  // ------------------------------------------------------------------------------------------
  // heat grids (packed rows, see report_data.pack_row)
  // ------------------------------------------------------------------------------------------
  var ALPHA = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_';
  var CODE = new Int16Array(128).fill(-1);
  for (var ai = 0; ai < ALPHA.length; ai++) CODE[ALPHA.charCodeAt(ai)] = ai;
  function unpackRow(row) {
    var out = new Array(NB).fill(null);
    if (!Array.isArray(row)) return out;
    var lo = row[0], hi = row[1], lg = row[2], codes = row[3];
    var llo = lg ? Math.log(lo) : 0, lhi = lg ? Math.log(hi) : 0;
    for (var c = 0; c < NB && 2 * c + 1 < codes.length; c++) {
      var k = CODE[codes.charCodeAt(2 * c)] * 64 + CODE[codes.charCodeAt(2 * c + 1)];
      if (k === 4095) continue;
      if (k === 4094) { out[c] = NaN; continue; }
      if (k === 4093) { out[c] = Infinity; continue; }
      if (k === 4092) { out[c] = -Infinity; continue; }
      var t = k / 4091;
      out[c] = lg ? Math.exp(llo + t * (lhi - llo)) : lo + t * (hi - lo);
    }
    return out;
  }
  var gridCache = new Map();
  function heatGrid(key, variant) {
    var id = key + '\u0000' + variant;
    if (!gridCache.has(id)) {
      var rows = get(D.heat, key, variant);
      gridCache.set(id, Array.isArray(rows) ? rows.map(function (r) { return r ? unpackRow(r) : null; }) : null);
    }
    return gridCache.get(id);
  }
  var HEAT_KEYS = Object.keys(D.heat || {});

  // ------------------------------------------------------------------------------------------
  // sections
  // ------------------------------------------------------------------------------------------
  var SECTIONS = [];
  function section(id, title, render) { SECTIONS.push({ id: id, title: title, render: render }); }

  // --- verdict ------------------------------------------------------------------------------
  /** The variant the page opens on: the attribution's suspect, else the earliest gate failure, else the last variant. */
  var FOCUS = (function () {
    var patch = get(D.attribution, 'verdict', 'patch');
    if (patch) {
      var names = ['only:' + patch, patch];
      for (var i = 0; i < names.length; i++) if (OPT.indexOf(names[i]) >= 0) return names[i];
    }
    var fails = CHECKS.filter(function (c) { return c.status === 'fail' && OPT.indexOf(c.variant) >= 0; });
    fails.sort(function (a, b) { return (typeof a.first_failing_layer === 'number' ? a.first_failing_layer : 1e9) - (typeof b.first_failing_layer === 'number' ? b.first_failing_layer : 1e9); });
    return fails.length ? fails[0].variant : (OPT[OPT.length - 1] || VARIANTS[0]);
  })();
  function checkInfo(row) { return get(GATE, 'check_info', row.check) || {}; }
  /** The series key a check (an index into check_names) judges, as the heatmap names it. */
  function checkMetric(index) { return get(GATE, 'check_info', get(GATE, 'check_names', index), 'metric'); }
  function failingRows() { return CHECKS.filter(function (c) { return c.status === 'fail'; }); }
  section('verdict', 'Verdict', function (el) {
    if (GATE) {
      var passed = GATE.passed;
      var fails = failingRows();
      var incomplete = GATE.verdict === 'incomplete';
      var cls = passed === true ? 'pass' : passed === false || incomplete ? 'fail' : 'neutral';
      var head = passed === true ? 'GATE PASSED' : passed === false ? 'GATE FAILED' : incomplete ? 'GATE: INCOMPLETE RUN (never passes)' : 'GATE RESULT: ' + plain(GATE.verdict);
      var counts = GATE.counts;
      var countText = counts ? plain(counts.pass) + ' of ' + plain(counts.testcases !== undefined ? counts.testcases : counts.checks) + ' check × variant pass' +
        (counts.fail ? ', ' + counts.fail + ' fail' : '') + (counts.warn ? ', ' + counts.warn + ' warn' : '') + (counts.no_data ? ', ' + counts.no_data + ' without data' : '')
        : CHECKS.length ? (CHECKS.length - fails.length) + ' of ' + CHECKS.length + ' checks pass' + (fails.length ? ', ' + fails.length + ' fail' : '') : 'no checks listed';
      var box = h('div', { class: 'banner ' + cls, id: 'gate-banner' },
        h('div', { class: 'headline', text: head + (GATE.policy ? ' · policy ' + plain(GATE.policy) : '') }),
        h('div', { text: countText + (GATE.policy_description ? ' — ' + plain(GATE.policy_description) : '') }));
      var ul = h('ul', { id: 'gate-failures' });
      if (Array.isArray(GATE.failing) && GATE.failing.length) {
        // the gate's own lines for what is not a check (an incomplete run, NaN/Inf), then each failing check × variant
        // with the unit where it first fails — layer, phase, group (chunk, turn, step, bin) and mode — earliest first
        var checkLines = GATE.failing.map(function (f) { return f.line; });
        var other = (GATE.failures || []).filter(function (line) { return checkLines.indexOf(line) < 0; });
        other.forEach(function (line) { ul.appendChild(h('li', { class: 'mono', text: line })); });
        var earliest = GATE.failing.slice().sort(function (a, b) {
          return (a.layer - b.layer) || ((a.phase === 'decode') - (b.phase === 'decode'));
        });
        earliest.slice(0, 8).forEach(function (f) {
          ul.appendChild(h('li', { class: 'gate-failure', title: f.line || null }, h('b', { text: plain(f.check) }), ' · ',
            h('span', { style: { color: colorOf(f.variant), fontWeight: 650 }, text: plain(f.variant) }), ': first fails at ', layerRef(f.layer), ' ',
            h('span', { class: 'where', text: unitWhere(f) }),
            ' — ' + info(tapKey(String(f.metric), f.tap)).label + (f.tap ? ' (' + plain(f.tap) + ')' : '') + ' loss ' + fmt(f.value) + ' > limit ' + fmt(f.limit) +
            (f.failing_units > 1 ? ' · ' + f.failing_units + ' failing units' : '')));
        });
        if (GATE.failing.length > 8) ul.appendChild(h('li', { text: 'and ' + (GATE.failing.length - 8) + ' more (see First failing layers)' }));
      } else if (Array.isArray(GATE.failures) && GATE.failures.length) {
        GATE.failures.slice(0, 8).forEach(function (line) { ul.appendChild(h('li', { class: 'mono', text: line })); });
        if (GATE.failures.length > 8) ul.appendChild(h('li', { text: 'and ' + (GATE.failures.length - 8) + ' more (see First failing layers)' }));
      } else {
        fails.slice(0, 8).forEach(function (c) {
          ul.appendChild(h('li', null, h('b', { text: plain(c.check || c.metric) }), ' · ' + plain(c.variant) + ' · ' + plain(c.phase) + ': first failing layer ',
            layerRef(c.first_failing_layer), ', worst ' + plain(c.worst_value) + ' vs bound ' + plain(c.bound !== undefined ? c.bound : c.worst_limit)));
        });
        if (fails.length > 8) ul.appendChild(h('li', { text: 'and ' + (fails.length - 8) + ' more (see First failing layers)' }));
      }
      if (ul.childNodes.length) box.appendChild(ul);
      (Array.isArray(GATE.notes) ? GATE.notes : []).forEach(function (n) { box.appendChild(h('div', { class: 'mono', text: 'note: ' + plain(n) })); });
      el.appendChild(box);
    } else {
      el.appendChild(h('div', { class: 'banner neutral', id: 'gate-banner' },
        h('div', { class: 'headline', text: 'Not gated' }),
        h('div', { text: 'No gate.json in the run directory (the run used --no-gate, or predates gating): `dsv4-drift gate RUN_DIR` judges it and redraws this page. Nothing on the page is coloured as pass or fail without the gate.' })));
    }
    var att = D.attribution;
    if (att && typeof att === 'object') {
      var v = att.verdict;
      var sb = h('div', { class: 'banner suspect', id: 'suspect-banner' });
      if (v && typeof v === 'object' && v.patch) {
        sb.appendChild(h('div', { class: 'headline' }, v.kind === 'interaction' ? 'Top suspect (interaction): ' : 'Top suspect: ', h('span', { class: 'mono', text: plain(v.patch) })));
        sb.appendChild(h('div', null, plain(v.phase) + ' phase, first at ', layerRef(v.first_layer),
          v.metric !== undefined && v.metric !== null ? ', ' + labelOf(String(v.metric)) + ' ' + plain(v.value) + (v.bound !== undefined && v.bound !== null ? ' (bound ' + plain(v.bound) + ')' : '') : '',
          v.check ? ' · check ' + plain(v.check) : ''));
      } else if (v && typeof v === 'object') {
        sb.appendChild(h('div', { class: 'headline', text: 'Attribution: ' + plain(v.summary || v.kind || 'no suspect') }));
      } else if (v) {
        sb.appendChild(h('div', { class: 'headline', text: 'Attribution: ' + plain(v) }));
      } else {
        sb.appendChild(h('div', { class: 'headline', text: 'Attribution names no suspect patch' }));
      }
      el.appendChild(sb);
    }
    var findings = Array.isArray(D.findings) ? D.findings : [];
    if (findings.length) {
      var fb = h('div', { class: 'banner nan', id: 'nan-banner' }, h('div', { class: 'headline', text: 'NaN/Inf: ' + findings.length + ' stack(s) produced non-finite values' }));
      var ul2 = h('ul');
      findings.slice(0, 6).forEach(function (f) {
        ul2.appendChild(h('li', null, h('b', { text: plain(f.variant) }), ' (' + plain(f.mode) + ') first at ', layerRef(f.layer),
          ', tap ' + plain(f.tap) + (f.field ? '.' + plain(f.field) : '') + ', ' + plain(f.phase) + ' position ' + plain(f.position)));
      });
      fb.appendChild(ul2);
      el.appendChild(fb);
    }
    var status = M.status;
    var done = D.layers_with_data || [];
    if (done.length < NL) {
      el.appendChild(h('div', { class: 'banner fail', id: 'incomplete-banner' }, h('div', { class: 'headline', text: 'Incomplete run' + (status ? ' (status: ' + plain(status) + ')' : '') }),
        h('div', { text: done.length + ' of ' + NL + ' layers have metrics; the report shows what was finished (`dsv4-drift run --resume` completes it).' })));
    }
    (D.problems || []).forEach(function (p) { el.appendChild(h('div', { class: 'error-box', text: p })); });
  });

  // --- run metadata -------------------------------------------------------------------------
  section('run', 'Run', function (el) {
    var sc = M.scenario || {}, model = M.model || {}, cfg = model.config || {}, prompt = M.prompt || {};
    var env = M.environment || {}, stacks = M.stacks || {}, measure = M.measure || {};
    var counts = {};
    LAYERS.forEach(function (l) { counts[l.kind] = (counts[l.kind] || 0) + 1; });
    var nHash = LAYERS.filter(function (l) { return l.hash; }).length;
    var schedule = Object.keys(counts).map(function (k) { return counts[k] + ' ' + k.toUpperCase(); }).join(', ') + (nHash ? ', ' + nHash + ' hash' : '');
    var weights = model.weights || {};
    var cards = h('div', { class: 'cards' });
    cards.appendChild(h('div', { class: 'card' }, h('h3', { text: 'Scenario' }), kv([
      ['name', h('b', { text: plain(sc.name) })], ['description', sc.description], ['file', sc.file],
      ['status', M.status], ['run directory', D.run_dir],
    ])));
    cards.appendChild(h('div', { class: 'card' }, h('h3', { text: 'Model' }), kv([
      ['config', cfg.name], ['layers', NL + ' (' + schedule + ')'],
      ['hidden / heads', plain(cfg.hidden_size) + ' / ' + plain(cfg.num_attention_heads) + '×' + plain(cfg.head_dim)],
      ['window / top-k', plain(cfg.sliding_window) + ' / ' + plain(cfg.index_topk)],
      ['compress m', 'CSA ' + plain(cfg.compress_rate_csa) + ', HCA ' + plain(cfg.compress_rate_hca)],
      ['experts', plain(cfg.n_routed_experts) + ' routed, ' + plain(cfg.num_experts_per_tok) + ' per token, ' + plain(cfg.n_shared_experts) + ' shared'],
      ['hc mult', cfg.hc_mult], ['weights', plain(weights)],
    ])));
    var turns = Array.isArray(prompt.turns) ? prompt.turns : [];
    var needles = prompt.needles && typeof prompt.needles === 'object' ? prompt.needles : {};
    cards.appendChild(h('div', { class: 'card' }, h('h3', { text: 'Prompt' }), kv([
      ['prompt tokens', prompt.n_prompt], ['decode steps', plain(prompt.n_decode) + (prompt.decode_source ? ' (' + plain(prompt.decode_source) + ')' : '')],
      ['chunk size', plain(prompt.chunk_size) + (prompt.reference_chunk_size !== undefined ? ' (reference ' + plain(prompt.reference_chunk_size) + ')' : '')],
      ['turns', turns.length ? turns.map(function (t) { return (t.turn < 0 ? 'preamble' : 'turn ' + t.turn) + ' [' + t.start + ', ' + t.end + ')'; }).join('; ') : '–'],
      ['needles', Object.keys(needles).length ? Object.keys(needles).map(function (k) { var n = needles[k] || {}; return k + ' [' + plain(n.start) + ', ' + plain(n.end) + ') in turn ' + plain(n.turn); }).join('; ') : 'none'],
      ['tokenizer', prompt.tokenizer], ['digest', prompt.digest],
    ])));
    // every patch once (id, phases, description, options), then each variant as its list of patch ids
    var patchInfo = new Map();
    (stacks.variants || []).forEach(function (v) {
      (Array.isArray(v.patches) ? v.patches : []).forEach(function (p) { if (p && !patchInfo.has(String(p.id))) patchInfo.set(String(p.id), p); });
    });
    var vlist = h('ul', { class: 'patch-list', id: 'variant-list' });
    (stacks.variants || []).forEach(function (v) {
      var ids = (Array.isArray(v.patches) ? v.patches : []).map(function (p) { return String(p && p.id); });
      vlist.appendChild(h('li', null, h('span', { style: { color: colorOf(v.name), fontWeight: 650 }, text: plain(v.name) }),
        ids.length ? [': ', ids.map(function (id, i) { return [i ? ', ' : '', h('span', { class: 'mono', text: id })]; })] : ' — no patches (stock low-precision stack)'));
    });
    var plist = h('ul', { class: 'patch-list', id: 'patch-list' });
    patchInfo.forEach(function (p, id) {
      plist.appendChild(h('li', null, h('span', { class: 'mono', style: { fontWeight: 650 }, text: id }), ' ',
        (Array.isArray(p.phases) ? p.phases : []).map(function (ph) { return h('span', { class: 'chip phase', text: ph }); }),
        ' ' + plain(p.description || ''), p.options && Object.keys(p.options).length ? h('span', { class: 'empty', text: ' (' + plain(p.options) + ')' }) : null,
        p.source && p.source !== 'built-in' ? h('span', { class: 'empty', text: ' from ' + plain(p.source) }) : null));
    });
    cards.appendChild(h('div', { class: 'card', style: { gridColumn: 'span 2' } }, h('h3', { text: 'Stacks and variants' }), kv([
      ['reference', plain(get(stacks, 'reference', 'dtype')) + (get(stacks, 'reference', 'parity') && stacks.reference.parity.length ? ' + parity ' + plain(stacks.reference.parity) : ' (pure)')],
      ['yardstick', stacks.yardstick ? 'bf16 re-execution of the reference graph (noise floor)' : 'off'],
      ['engine', plain(stacks.engine)], ['modes', MODES.join(', ')],
      ['measure', 'bins of ' + plain(measure.bin_size) + ' tokens, attention every ' + plain(measure.attn_sample_every) + ', logits every ' + plain(measure.logits_sample_every)],
    ]), h('h3', { style: { marginTop: '8px' }, text: 'Variants' }), vlist, patchInfo.size ? [h('h3', { style: { marginTop: '8px' }, text: 'Patches' }), plist] : null));
    cards.appendChild(h('div', { class: 'card' }, h('h3', { text: 'Environment' }), kv([
      ['device', plain(env.device_name) + (env.device ? ' (' + plain(env.device) + ')' : '')],
      ['compute capability', env.compute_capability === null || env.compute_capability === undefined ? '– (not a GPU)' : env.compute_capability],
      ['dsv4-drift', env.dsv4_drift], ['torch', env.torch], ['triton', env.triton], ['cuda', env.cuda], ['python', env.python],
      ['platform', env.platform], ['threads', env.torch_threads],
    ])));
    cards.appendChild(h('div', { class: 'card' }, h('h3', { text: 'Times' }), kv([
      ['started', M.started], ['finished', M.finished], ['wall', M.wall_seconds !== undefined ? fmt(M.wall_seconds) + ' s' : undefined],
      ['metric rows', D.rows], ['gate policy', get(M, 'gate', 'policy')],
    ])));
    el.appendChild(cards);
    if (sc.text) el.appendChild(h('details', null, h('summary', { text: 'scenario file as run' }), h('pre', { class: 'scenario', text: sc.text })));
  });

  // --- summary --------------------------------------------------------------------------------
  var SUMMARY = [
    { key: 'streams.rel_l2', label: 'stream rel L2' },
    { key: 'attn.tv', label: 'attention TV' },
    { key: 'indexer.recall', label: 'indexer recall' },
    { key: 'indexer.mass_recall', label: 'mass recall' },
    { key: 'ctx.needle_recall', label: 'needle recall' },
    { key: 'moe.flip_rate', label: 'expert flip rate' },
    { key: 'logits.kl', label: 'logits KL' },
    { key: 'logits.top1_agree', label: 'top-1 agree' },
  ];
  /** A gate loss back in the metric's own units: 1 − loss for recalls and agreement (the gate bounds 1 − x). */
  function fromLoss(key, loss) { return isNum(loss) && info(key).better === 'higher' ? 1 - loss : loss; }
  /**
   * One summary cell, global mode. Judged by the gate: the layer where the gate holds the metric closest to (or
   * furthest past) its limit, the metric there as the gate aggregates it, and that ratio (the colour). Not
   * judged: the largest per-layer mean (the lowest for recalls and agreement; the logits row's mean), uncoloured.
   */
  function summaryValue(variant, phase, col) {
    var cell = variant === YARD ? null : get(GATE, 'cells', col.key, variant, 'global', phase);
    if (cell && cell.ratio) {
      var at = null;
      cell.ratio.forEach(function (r, i) {
        if (r === null || r === undefined) return;
        var score = Number.isNaN(r) ? Infinity : r, best = at === null ? null : (Number.isNaN(cell.ratio[at]) ? Infinity : cell.ratio[at]);
        if (at === null || score > best) at = i;
      });
      if (at !== null) return { v: fromLoss(col.key, cell.value[at]), at: at, lr: cellVerdict(cell, at, phase, 'global') };
    }
    if (col.key.indexOf('logits.') === 0) { var l = get(D.logits, variant, phase, col.key); return l ? { v: l.mean, at: NL } : null; }
    var vals = series('global', variant, col.key, phase, 'mean');
    if (!vals) return null;
    var higher = info(col.key).better === 'higher', pick = null, where = null;
    vals.forEach(function (v, i) {
      if (v === null || v === undefined) return;
      if (Number.isNaN(v)) { if (pick === null || !Number.isNaN(pick)) { pick = v; where = i; } return; }
      if (pick === null || (!Number.isNaN(pick) && (higher ? v < pick : v > pick))) { pick = v; where = i; }
    });
    return pick === null ? null : { v: pick, at: where };
  }
  section('summary', 'Summary', function (el) {
    el.appendChild(h('p', { class: 'note', text: 'Global mode (each variant runs on its own previous-layer output). Each cell: where the gate holds the metric closest to its limit (or furthest past it), the metric there as the gate aggregates it (mean over the layer’s positions unless the check says otherwise; recalls as 1 − its loss) and the layer (@L…; @logits for the final logits). ' + UNCHECKED_RULE + ' An uncoloured cell shows the largest per-layer mean (the lowest for recalls and agreement).' }));
    var t = h('table', { class: 'data', id: 'summary-table' });
    t.appendChild(h('thead', null, h('tr', null, h('th', { class: 'left', text: 'variant' }), h('th', { class: 'left', text: 'phase' }),
      SUMMARY.map(function (c) { return h('th', { text: c.label }); }))));
    var tb = h('tbody');
    VARIANTS.forEach(function (variant) {
      PHASES.forEach(function (phase) {
        var tr = h('tr', null, h('td', { class: 'left' }, h('span', { style: { color: colorOf(variant), fontWeight: 650 }, text: variant })), h('td', { class: 'left', text: phase }));
        SUMMARY.forEach(function (col) {
          var me = summaryValue(variant, phase, col);
          if (!me) { tr.appendChild(h('td', { class: 'na', text: '·' })); return; }
          var where = me.at === NL ? 'logits' : 'L' + me.at;
          tr.appendChild(h('td', { class: me.lr ? ratioClass(me.lr.r) : '', 'data-gated': me.lr ? (me.lr.r > 1 || Number.isNaN(me.lr.r) ? 'fail' : 'pass') : null,
            title: where + ': ' + gateTitle(me.lr), text: fmt(me.v) + ' @' + where }));
        });
        tb.appendChild(tr);
      });
    });
    t.appendChild(tb);
    el.appendChild(h('div', { class: 'table-wrap', style: { maxHeight: 'none' } }, t));
  });

  // --- per-layer table ----------------------------------------------------------------------
  var TABLE_COLUMNS = ['streams.rel_l2', 'attn.tv', 'attn.out_rel_l2', 'indexer.recall', 'indexer.mass_recall',
    'indexer.boundary_recall', 'mhc.comb_rel_err@attn.hc', 'mhc.comb_rel_err@ffn.hc', 'mhc.comb_rel_err', 'moe.flip_rate',
    'moe.out_rel_l2', 'ctx.earlier_turn_recall', 'ctx.needle_recall', 'streams.amplification',
    // fp32 decision sites, held to their benign twin (`twin:` bounds): the variant's op against the stock op
    'mhc.site_rel_err@attn.hc.site', 'mhc.site_rel_err@ffn.hc.site', 'mhc.post_site_excess@attn.hc.post.site',
    'mhc.post_site_excess@ffn.hc.post.site', 'moe.site_flip_rate', 'moe.site_weight_err',
    'indexer.site_recall', 'indexer.site_margin_loss', 'indexer.site_future', 'attn.site_lse_err', 'attn.kv_site_mismatch',
    'moe.clamp_site_miss@moe.experts.site', 'moe.clamp_site_miss@moe.shared.site', 'moe.clamp_site_miss',
    'moe.pair_site_loss@moe.experts.site', 'moe.pair_site_loss@moe.shared.site', 'moe.pair_site_loss',
    'moe.expert_site_bias@moe.experts.site', 'moe.expert_site_bias@moe.shared.site', 'moe.expert_site_bias'];
  section('layers', 'Per-layer drift', function (el) {
    var st = { variant: FOCUS, mode: 'global', agg: 'mean', phase: 'both', sort: null, asc: false };
    var cols = TABLE_COLUMNS.filter(function (k) { return D.metrics && D.metrics[k]; });
    var host = h('div');
    var controls = h('div', { class: 'controls' });
    function rebuildControls() {
      clear(controls);
      controls.appendChild(selectBox('variant', VARIANTS, st.variant, function (v) { st.variant = v; draw(); }));
      controls.appendChild(selectBox('mode', MODES.map(function (m) { return { value: m, label: m + (m === 'global' ? ' (accumulated)' : m === 'local' ? ' (this layer alone)' : ' (reference decisions forced)') }; }), st.mode, function (v) { st.mode = v; draw(); }));
      controls.appendChild(selectBox('per layer', [{ value: 'mean', label: 'mean over positions' }, { value: 'worst', label: 'worst position / bin' }], st.agg, function (v) { st.agg = v; draw(); }));
      controls.appendChild(selectBox('phase', [{ value: 'both', label: 'prefill and decode' }, { value: 'prefill', label: 'prefill' }, { value: 'decode', label: 'decode' }], st.phase, function (v) { st.phase = v; draw(); }));
    }
    rebuildControls();
    el.appendChild(h('p', { class: 'note', text: 'One row per layer, showing the chosen per-layer aggregate. ' + UNCHECKED_RULE + ' The colour is the gate’s verdict at that layer whichever aggregate is shown (hover for the check, its loss and limit). Click a column header to sort (worst first); click “layer” to restore the order. An outlined cell is the first layer the gate fails.' }));
    el.appendChild(controls);
    el.appendChild(h('div', { class: 'legend' }, [['c-good', 'var(--ok-bg)', 'passes, ≤ ½ its limit'], ['c-warn', 'var(--warn-bg)', 'passes, up to its limit'], ['c-bad', 'var(--bad-bg)', 'fails: beyond its limit'], ['c-bad2', 'var(--bad-bg2)', '> 2.5× its limit'], ['c-bad3', 'var(--bad-bg3)', '> 6× its limit or NaN'], ['', 'transparent', 'not judged by the gate']].map(function (x) {
      return h('span', null, h('span', { class: 'sw', style: { background: x[1] } }), x[2]);
    })));
    el.appendChild(host);
    function draw() {
      clear(host);
      var phases = st.phase === 'both' ? PHASES : [st.phase];
      var colDefs = [];
      cols.forEach(function (key) {
        phases.forEach(function (phase) {
          var vals = series(st.mode, st.variant, key, phase, st.agg);
          colDefs.push({ key: key, phase: phase, vals: vals || [] });
        });
      });
      colDefs = colDefs.filter(function (c) { return c.vals.some(function (v) { return v !== null && v !== undefined; }); });
      var groups = [];
      colDefs.forEach(function (c) { if (!groups.length || groups[groups.length - 1].key !== c.key) groups.push({ key: c.key, n: 0 }); groups[groups.length - 1].n++; });
      var t = h('table', { class: 'data', id: 'layer-table' });
      var layerTh = h('th', { class: 'left sticky sortable' + (st.sort === null ? ' sorted asc' : ''), rowspan: 2, text: 'layer', onclick: function () { st.sort = null; draw(); } });
      var th1 = h('tr', null, layerTh, h('th', { class: 'left', rowspan: 2, text: 'kind' }));
      groups.forEach(function (g) { th1.appendChild(h('th', { class: 'group', colspan: g.n, title: g.key, text: labelOf(g.key) })); });
      var th2 = h('tr');
      var rows = [];
      for (var i = 0; i < NL; i++) rows.push(i);
      colDefs.forEach(function (c, ci) {
        var th = h('th', { class: 'sortable' + (ci === 0 || colDefs[ci - 1].key !== c.key ? ' gl' : '') + (st.sort === ci ? ' sorted' + (st.asc ? ' asc' : '') : ''), text: c.phase, title: 'sort by ' + labelOf(c.key) + ' (' + c.phase + ')' });
        th.addEventListener('click', function () { if (st.sort === ci) st.asc = !st.asc; else { st.sort = ci; st.asc = false; } draw(); });
        th2.appendChild(th);
      });
      t.appendChild(h('thead', null, th1, th2));
      if (st.sort !== null && colDefs[st.sort]) {
        var c = colDefs[st.sort];
        var score = function (i) { var b = badness(c.key, c.vals[i]); if (b === null) b = isNum(c.vals[i]) ? c.vals[i] : null; if (c.vals[i] !== null && Number.isNaN(c.vals[i])) return Infinity; return b === null ? -Infinity : b; };
        rows.sort(function (a, b) { return st.asc ? score(a) - score(b) : score(b) - score(a); });
      }
      var firstCross = colDefs.map(function (c) {
        for (var i = 0; i < NL; i++) { var lr = limitRatio(c.key, st.variant, c.phase, i, c.vals[i], st.mode); if (lr && (lr.r > 1 || Number.isNaN(lr.r))) return i; }
        return -1;
      });
      var tb = h('tbody');
      rows.forEach(function (i) {
        var tr = h('tr', { 'data-layer': i }, h('td', { class: 'left sticky', text: 'L' + i }), h('td', { class: 'left' }, kindChip(i)));
        colDefs.forEach(function (c, ci) {
          var v = c.vals[i];
          var gl = ci === 0 || colDefs[ci - 1].key !== c.key ? ' gl' : '';
          if (v === null || v === undefined) { tr.appendChild(h('td', { class: 'na' + gl, text: '·' })); return; }
          var lr = limitRatio(c.key, st.variant, c.phase, i, v, st.mode);
          var cls = (lr ? ratioClass(lr.r) : '') + gl + (firstCross[ci] === i ? ' first-cross' : '');
          var title = labelOf(c.key) + ' · ' + c.phase + ' · layer ' + i + ': ' + fmt(v) + '\n' + gateTitle(lr);
          tr.appendChild(h('td', { class: cls, title: title, text: fmt(v), 'data-gated': lr ? (lr.r > 1 || Number.isNaN(lr.r) ? 'fail' : 'pass') : null }));
        });
        tb.appendChild(tr);
      });
      t.appendChild(tb);
      host.appendChild(h('div', { class: 'table-wrap' }, t));
    }
    draw();
  });

  // --- drift-vs-layer charts ----------------------------------------------------------------
  var FAMILIES = [
    ['streams', 'Hidden streams', 'streams.rel_l2'], ['attention', 'Attention', 'attn.tv'], ['indexer', 'Indexer top-k', 'indexer.recall'],
    ['mhc', 'mHC (hyper-connections)', 'mhc.comb_rel_err@attn.hc'], ['moe', 'MoE routing', 'moe.flip_rate'], ['context', 'Context loss', 'ctx.earlier_turn_recall'],
  ];
  function familyKeys(family) {
    return Object.keys(D.metrics || {}).filter(function (k) { return D.metrics[k].family === family; }).sort(function (a, b) {
      var ka = Object.keys(D.metrics).indexOf(a), kb = Object.keys(D.metrics).indexOf(b); return ka - kb;
    });
  }
  function variantSeries(mode, key, phase, agg, opts) {
    opts = opts || {};
    return VARIANTS.map(function (v) {
      var vals = series(v === YARD ? yardMode(mode) : mode, v, key, phase, agg);
      return { name: v, color: colorOf(v), dash: v === YARD ? '5 3' : opts.dash || null, values: vals, hidden: hidden.has(v), width: v === YARD ? 1.4 : 1.7 };
    });
  }
  section('charts', 'Drift vs layer', function (el) {
    var st = { mode: 'global', agg: 'mean' };
    var families = FAMILIES.filter(function (f) { return familyKeys(f[0]).length; });
    Object.keys(D.metrics || {}).forEach(function (k) {
      var fam = D.metrics[k].family;
      if (fam !== 'logits' && !families.some(function (f) { return f[0] === fam; })) families.push([fam, fam, k]);
    });
    var choice = {};
    families.forEach(function (f) { var keys = familyKeys(f[0]); choice[f[0]] = keys.indexOf(f[2]) >= 0 ? f[2] : keys[0]; });
    el.appendChild(h('p', { class: 'note', text: 'Each card: one metric of a DESIGN §4 family, prefill left and decode right, every variant (solid) and the yardstick (dashed grey). The strip under each x axis is the layer kind (blue SWA, green CSA, orange HCA; purple dot: hash-routed). Hover for values; click a legend entry to hide a variant everywhere.' }));
    var controls = h('div', { class: 'controls' },
      selectBox('mode', MODES, st.mode, function (v) { st.mode = v; draw(); }),
      selectBox('per layer', [{ value: 'mean', label: 'mean over positions' }, { value: 'worst', label: 'worst position / bin' }], st.agg, function (v) { st.agg = v; draw(); }));
    var leg = h('div'), grid = h('div', { class: 'chart-grid pairs' });
    el.appendChild(controls); el.appendChild(kindLegend()); el.appendChild(leg); el.appendChild(grid);
    function draw() {
      clear(leg).appendChild(variantLegend());
      clear(grid);
      families.forEach(function (f) {
        var keys = familyKeys(f[0]);
        var key = choice[f[0]];
        var m = info(key);
        var card = h('div', { class: 'chart-card' }, h('div', { class: 'head' }, h('h3', { text: f[1] }),
          selectBox('', keys.map(function (k) { return { value: k, label: labelOf(k) }; }), key, function (v) { choice[f[0]] = v; draw(); })));
        var pair = h('div', { class: 'chart-pair' });
        PHASES.forEach(function (phase) {
          var ax = layerAxis();
          pair.appendChild(lineChart(Object.assign(ax, {
            title: phase, series: variantSeries(st.mode, key, phase, st.agg), scale: m.scale, upperOne: m.better === 'higher', width: 380, height: 210,
          })));
        });
        card.appendChild(pair);
        grid.appendChild(card);
      });
    }
    redrawers.push(draw);
    draw();
  });

  // --- heatmap --------------------------------------------------------------------------------
  section('heatmap', 'Layer × position heatmap', function (el) {
    if (!HEAT_KEYS.length || !NB) { el.appendChild(h('p', { class: 'empty', text: 'No per-position metrics in this run.' })); return; }
    // open on the metric of the focus variant's first failing group, when the heatmap carries it
    var firstGroupKey = (get(GATE, 'failing_groups', FOCUS) || []).map(function (e) { return checkMetric(e.check); })
      .filter(function (k) { return HEAT_KEYS.indexOf(k) >= 0; })[0];
    var st = { key: firstGroupKey || (HEAT_KEYS.indexOf('streams.rel_l2') >= 0 ? 'streams.rel_l2' : HEAT_KEYS[0]), variant: FOCUS, view: 'value', failures: 'all' };
    el.appendChild(h('p', { class: 'note', text: 'Global mode, one row per layer and one column per position bin (prefill bins, then one column per decode step). Solid dark lines: prefill chunk boundaries; thick line: prefill → decode; dashed orange: turn boundaries. Colour “value”: pale = close to the reference, dark red = far (recall-like metrics are drawn as 1 − value). “× yardstick”: blue = better than the bf16 noise floor, white = equal, red = worse. Blue outlines: the groups (prefill chunk, turn, decode step or bin) where a gate check of a group scope fails for this variant, in that check’s mode (a local-mode failure is outlined on these global-mode values); hover for the check.' }));
    var controls = h('div', { class: 'controls' });
    var bar = h('div', { class: 'colorbar' });
    var wrap = h('div', { class: 'heat-wrap', id: 'heatmap-canvas' });
    el.appendChild(controls); el.appendChild(bar); el.appendChild(wrap);
    function rebuild() {
      clear(controls);
      controls.appendChild(selectBox('metric', HEAT_KEYS.map(function (k) { return { value: k, label: labelOf(k) }; }), st.key, function (v) { st.key = v; draw(); }));
      controls.appendChild(selectBox('variant', VARIANTS.filter(function (v) { return get(D.heat, st.key, v); }), st.variant, function (v) { st.variant = v; draw(); }));
      controls.appendChild(selectBox('colour', [{ value: 'value', label: 'value' }, { value: 'ratio', label: '× yardstick' }], st.view, function (v) { st.view = v; draw(); }));
      if (GATE) controls.appendChild(selectBox('outline failing groups', [{ value: 'all', label: 'of every check' }, { value: 'metric', label: 'of checks on this metric' }, { value: 'none', label: 'none' }], st.failures, function (v) { st.failures = v; draw(); }));
    }
    /** The failing groups to outline: gate.json's failing units of group scopes for the variant, as bin ranges per layer. */
    function failingGroups() {
      if (st.failures === 'none') return [];
      var metric = info(st.key).metric;
      return (get(GATE, 'failing_groups', st.variant) || []).filter(function (e) { return st.failures === 'all' || checkMetric(e.check) === metric; });
    }
    function draw() {
      rebuild();
      clear(wrap); clear(bar);
      var grid = heatGrid(st.key, st.variant);
      if (!grid) { wrap.appendChild(h('p', { class: 'empty', text: 'not measured for this variant' })); return; }
      var yard = heatGrid(st.key, YARD);
      var m = info(st.key);
      var directional = m.better !== 'neutral';
      var sval = function (v) { return directional ? badness(st.key, v) : v; };
      var ratioView = st.view === 'ratio' && yard && st.variant !== YARD && directional;
      var lo = Infinity, hi = -Infinity;
      grid.forEach(function (row) { if (row) row.forEach(function (v) { var x = sval(v); if (finite(x)) { if (x < lo) lo = x; if (x > hi) hi = x; } }); });
      var logScale = lo > 0 && hi / lo > 10;
      var tOf = function (x) {
        if (!finite(x)) return null;
        if (hi <= lo) return 0.5;
        return logScale ? (Math.log(Math.max(x, lo)) - Math.log(lo)) / (Math.log(hi) - Math.log(lo)) : (x - lo) / (hi - lo);
      };
      var colorCell = function (r, c) {
        var v = grid[r] ? grid[r][c] : null;
        if (v === null || v === undefined) return null;
        if (!Number.isFinite(v)) return '#111';
        if (ratioView) {
          var y = yard[r] ? yard[r][c] : null, a = sval(v), b = sval(y);
          if (a === null || b === null || !finite(b)) return '#d0d4da';
          var rr = b > 0 ? a / b : (a > 0 ? 8 : 1);
          return ramp(DIV, (Math.log2(Math.max(rr, 1 / 8)) + 3) / 6);
        }
        return ramp(SEQ, tOf(sval(v)));
      };
      // colour bar
      var cb = document.createElement('canvas'); cb.width = 180; cb.height = 10;
      var cx = cb.getContext('2d');
      for (var i = 0; i < 180; i++) { cx.fillStyle = ratioView ? ramp(DIV, i / 179) : ramp(SEQ, i / 179); cx.fillRect(i, 0, 1, 10); }
      var back = function (x) { return m.better === 'higher' ? 1 - x : m.better === 'sqnr' ? -20 * Math.log10(x) : x; };
      if (ratioView) bar.append('⅛× yardstick', cb, '8× yardstick');
      else if (finite(lo)) bar.append(fmt(directional ? back(lo) : lo), cb, fmt(directional ? back(hi) : hi), h('span', { text: ' ' + labelOf(st.key) + (logScale ? ' (log scale)' : '') }));
      bar.appendChild(h('span', { text: '  · black: NaN/Inf · grey: not measured' }));

      var gutL = 92, gutT = 34, gutB = 26;
      var avail = Math.max((wrap.clientWidth || 1000) - gutL - 20, 240);
      var cw = Math.max(3, Math.min(48, Math.floor(avail / NB)));
      var ch = Math.max(9, Math.min(26, Math.floor(560 / Math.max(NL, 1))));
      var Wd = gutL + NB * cw + 12, Ht = gutT + NL * ch + gutB;
      var dpr = window.devicePixelRatio || 1;
      var cv = document.createElement('canvas');
      cv.width = Math.round(Wd * dpr); cv.height = Math.round(Ht * dpr);
      cv.style.width = Wd + 'px'; cv.style.height = Ht + 'px';
      cv.setAttribute('data-rows', String(NL)); cv.setAttribute('data-cols', String(NB));
      var g = cv.getContext('2d');
      g.scale(dpr, dpr);
      g.font = '10px system-ui, sans-serif';
      g.textBaseline = 'middle';
      for (var r = 0; r < NL; r++) {
        var l = LAYERS[r] || {};
        var y = gutT + r * ch;
        g.fillStyle = KIND_COLOR[l.kind] || '#ccc';
        g.fillRect(gutL - 34, y + 1, 28, ch - 2);
        g.fillStyle = '#1d2330';
        g.textAlign = 'right';
        g.fillText('L' + r, gutL - 38, y + ch / 2);
        g.textAlign = 'center';
        g.fillText(String(l.kind || '?').toUpperCase() + (l.hash ? '#' : ''), gutL - 20, y + ch / 2);
        for (var c = 0; c < NB; c++) {
          var col = colorCell(r, c);
          g.fillStyle = col || '#eceef2';
          g.fillRect(gutL + c * cw, y, cw, ch);
        }
      }
      // boundaries and labels
      var lastTurnLabel = -1e9, lastChunkLabel = -1e9;
      g.textAlign = 'left';
      for (var cc = 0; cc < NB; cc++) {
        var x = gutL + cc * cw;
        var newTurn = cc === 0 || BINS.turn[cc] !== BINS.turn[cc - 1];
        var newPhase = cc > 0 && BINS.phase[cc] !== BINS.phase[cc - 1];
        var newChunk = cc === 0 || (BINS.phase[cc] === 'prefill' && BINS.chunk[cc] !== BINS.chunk[cc - 1]);
        if (cc > 0 && (newPhase || newChunk)) {
          g.strokeStyle = '#1d2330'; g.lineWidth = newPhase ? 2.5 : 1.2; g.setLineDash([]);
          g.beginPath(); g.moveTo(x, gutT - 14); g.lineTo(x, gutT + NL * ch); g.stroke();
        }
        if (cc > 0 && newTurn) {
          g.strokeStyle = '#d9480f'; g.lineWidth = 1.4; g.setLineDash([4, 3]);
          g.beginPath(); g.moveTo(x, gutT - 26); g.lineTo(x, gutT + NL * ch); g.stroke(); g.setLineDash([]);
        }
        if (newTurn && x >= lastTurnLabel) {
          var tl = BINS.turn[cc] < 0 ? 'preamble' : 'turn ' + BINS.turn[cc];
          g.fillStyle = '#d9480f'; g.fillText(tl, x + 2, 8); lastTurnLabel = x + g.measureText(tl).width + 8;
        }
        if ((newChunk || newPhase) && x >= lastChunkLabel) {
          var cl = BINS.phase[cc] === 'decode' ? 'decode' : 'chunk ' + BINS.chunk[cc];
          g.fillStyle = '#1d2330'; g.fillText(cl, x + 2, 22); lastChunkLabel = x + g.measureText(cl).width + 8;
        }
      }
      var every = Math.max(1, Math.ceil(56 / cw)), lastTick = -1e9;
      g.fillStyle = '#5d6677'; g.textAlign = 'center';
      for (var tc = 0; tc < NB; tc += every) {
        var tx = gutL + tc * cw + cw / 2;
        if (tx < lastTick) continue;
        g.fillText(String(BINS.pos_bin[tc]), tx, gutT + NL * ch + 10);
        lastTick = tx + 40;
      }
      g.textAlign = 'left';
      g.fillText('token position (bin start) →', gutL, gutT + NL * ch + 21);
      // one outline per run of failing bins in a row: the union over checks (groups of different scopes overlap)
      var outlined = failingGroups(), failingBins = new Map(), boxes = 0;
      outlined.forEach(function (e) {
        Object.keys(e.layers).forEach(function (layer) {
          if (!failingBins.has(layer)) failingBins.set(layer, new Uint8Array(NB));
          var row = failingBins.get(layer);
          e.layers[layer].forEach(function (range) { row.fill(1, range[0], range[1]); });
        });
      });
      g.setLineDash([]);
      failingBins.forEach(function (row, layer) {
        for (var b0 = 0; b0 < NB; b0++) {
          if (!row[b0]) continue;
          var b1 = b0;
          while (b1 < NB && row[b1]) b1++;
          var box = [gutL + b0 * cw + 1, gutT + Number(layer) * ch + 1, Math.max((b1 - b0) * cw - 2, 1), ch - 2];
          // blue on a white halo: visible on every shade of the colour ramp
          g.strokeStyle = '#ffffff'; g.lineWidth = 4; g.strokeRect(box[0], box[1], box[2], box[3]);
          g.strokeStyle = '#1f4fd6'; g.lineWidth = 2; g.strokeRect(box[0], box[1], box[2], box[3]);
          boxes++;
          b0 = b1;
        }
      });
      cv.setAttribute('data-failing-groups', String(boxes));
      cv.addEventListener('mousemove', function (ev) {
        var rect = cv.getBoundingClientRect();
        var c = Math.floor((ev.clientX - rect.left - gutL) / cw), r = Math.floor((ev.clientY - rect.top - gutT) / ch);
        if (c < 0 || c >= NB || r < 0 || r >= NL) { hideTooltip(); return; }
        var v = grid[r] ? grid[r][c] : null, y = yard && yard[r] ? yard[r][c] : null;
        var rows = [{ name: st.variant, color: colorOf(st.variant), value: fmt(v) }];
        if (yard && st.variant !== YARD) rows.push({ name: 'yardstick', color: YARD_COLOR, value: fmt(y) });
        var a = sval(v), b = sval(y);
        if (directional && a !== null && b !== null && st.variant !== YARD) rows.push({ name: 'error × yardstick', value: fmtRatio(b > 0 ? a / b : (a > 0 ? Infinity : 1)) });
        outlined.forEach(function (e) {
          if ((e.layers[String(r)] || []).some(function (range) { return range[0] <= c && c < range[1]; })) {
            rows.push({ name: 'fails: ' + plain(get(GATE, 'check_names', e.check)) + ' (' + e.mode + ')', color: '#1f4fd6',
              value: groupText(e.scope, binGroup(e.scope, c), [BINS.pos_bin[c], BINS.pos_end[c]], BINS.phase[c]) });
          }
        });
        var l = LAYERS[r] || {};
        showTooltip(ev, 'layer ' + r + ' · ' + String(l.kind).toUpperCase() + (l.hash ? ' · hash' : '') + ' — ' + binLabel(c), rows);
      });
      cv.addEventListener('mouseleave', hideTooltip);
      wrap.appendChild(cv);
    }
    draw();
    var pending = null;
    window.addEventListener('resize', function () { clearTimeout(pending); pending = setTimeout(draw, 150); });
  });

  // --- indexer recall vs position -------------------------------------------------------------
  section('indexer', 'Indexer recall vs position (CSA layers)', function (el) {
    var keys = ['indexer.recall', 'indexer.mass_recall', 'indexer.boundary_recall', 'ctx.earlier_turn_recall', 'ctx.needle_recall'].filter(function (k) { return HEAT_KEYS.indexOf(k) >= 0; });
    if (!keys.length) { el.appendChild(h('p', { class: 'empty', text: 'No indexer metrics in this run (no CSA layers, or not measured).' })); return; }
    var st = { key: keys[0], variant: FOCUS };
    el.appendChild(h('p', { class: 'note', text: 'Per position bin, global mode: thin lines are the individual CSA layers (colour = depth, dark purple shallow → green deep), the black line their mean, the dashed grey line the yardstick’s mean. Vertical lines: chunk (dark), decode (thick) and turn (dashed orange) boundaries.' }));
    var controls = h('div', { class: 'controls' }), host = h('div', { class: 'chart-card' });
    el.appendChild(controls); el.appendChild(host);
    function draw() {
      clear(controls);
      controls.appendChild(selectBox('metric', keys.map(function (k) { return { value: k, label: labelOf(k) }; }), st.key, function (v) { st.key = v; draw(); }));
      controls.appendChild(selectBox('variant', VARIANTS, st.variant, function (v) { st.variant = v; draw(); }));
      clear(host);
      var grid = heatGrid(st.key, st.variant) || [], yard = heatGrid(st.key, YARD) || [];
      var layers = [];
      grid.forEach(function (row, i) { if (row && row.some(function (v) { return v !== null; })) layers.push(i); });
      var mean = function (g) {
        var out = [];
        for (var c = 0; c < NB; c++) {
          var sum = 0, n = 0;
          g.forEach(function (row) { if (row && finite(row[c])) { sum += row[c]; n++; } });
          out.push(n ? sum / n : null);
        }
        return out;
      };
      var ser = layers.map(function (i, j) {
        return { name: 'L' + i, color: ramp(DEPTH, layers.length > 1 ? 0.85 * j / (layers.length - 1) : 0.5), values: grid[i], width: 0.9, opacity: 0.85, markers: false };
      });
      ser.push({ name: 'mean of CSA layers', color: REF_COLOR, values: mean(grid), width: 2.4, markers: false });
      if (st.variant !== YARD && yard.length) ser.push({ name: 'yardstick mean', color: YARD_COLOR, dash: '5 3', values: mean(yard), width: 1.6, markers: false });
      var ax = binAxis();
      host.appendChild(lineChart(Object.assign(ax, { series: ser, scale: 'linear', upperOne: true, height: 250, width: 1200, wide: true, tooltipSort: 'asc', tooltipMax: 10, title: labelOf(st.key) + ' · ' + st.variant })));
      host.appendChild(legend([
        { name: 'shallow CSA layer', color: ramp(DEPTH, 0), toggle: false }, { name: 'deep CSA layer', color: ramp(DEPTH, 0.85), toggle: false },
        { name: 'mean', color: REF_COLOR, toggle: false }, { name: 'yardstick mean', color: YARD_COLOR, dash: true, toggle: false },
        { name: 'turn boundary', color: '#d9480f', dash: true, toggle: false }, { name: 'chunk / decode boundary', color: '#1d2330', toggle: false },
      ]));
    }
    draw();
  });

  // --- context-loss lens ---------------------------------------------------------------------
  /** A series key of a metric the run records under several taps (`metric@tap`), else the metric itself. */
  function tapKey(metric, tap) { return D.metrics && D.metrics[metric + '@' + tap] ? metric + '@' + tap : metric; }
  /**
   * The context-loss lens's outcome (payload `needles`, harness.report.data.needle_outcome): per stack, how many
   * needle queries it answers at the final logits, the answers it loses where the reference was sure, the median
   * margin, and per layer the answer rate through the logit lens — where the answer appears (the retrieval layers)
   * and where a stack loses it. The lost counts are coloured by the gate's needle-lost verdict, like every colour.
   */
  function needleOutcome() {
    var N = D.needles, planted = Object.keys(get(M, 'prompt', 'needles') || {});
    var box = h('div', { id: 'needle-outcome', class: 'outcome' }, h('h3', { text: 'Needle answer' }));
    if (!N || !N.stacks) {
      box.appendChild(h('p', { class: 'empty', id: 'no-needle-queries', text: planted.length
        ? 'No decode step asks for a needle: add decode steps that recall the needles (' + planted.join(', ') + '), so that a step’s next token can only come from a needle planted turns earlier.'
        : 'The prompt plants no needles, so no decode step asks for one: plant needles in an early turn (a message’s `needles`, or the agent-session generator’s `needles: N`) and add decode steps that recall them.' }));
      return box;
    }
    var ref = N.reference || {}, names = Object.keys(N.stacks);
    var first = function (vals) { var i = (vals || []).findIndex(function (v) { return finite(v) && v > 0; }); return i < 0 ? null : i; };
    var pct = function (r) { return isNum(r) ? Math.round(100 * r) + '%' : '–'; };
    box.appendChild(h('p', { class: 'headline-text', id: 'needle-summary' }, 'Over ' + N.queries + ' needle quer' + (N.queries === 1 ? 'y' : 'ies') + ' (decode steps whose next token only a needle gives), at the final logits: the reference answers ',
      h('b', { text: plain(ref.answered) + ' (' + pct(ref.rate) + ')' }),
      names.map(function (v) {
        var st = N.stacks[v];
        return [', ', h('span', { style: { color: colorOf(v), fontWeight: 650 }, text: v }), ' ' + plain(st.answered) + (st.lost ? ' (' + st.lost + ' lost)' : '')];
      }), '.'));
    var lostKey = tapKey('ctx.needle_lost', 'logits'), lensLostKey = tapKey('ctx.needle_lost', 'needle.lens');
    var t = h('table', { class: 'data', id: 'needle-table' });
    t.appendChild(h('thead', null, h('tr', null, ['stack', 'answered at the final logits', 'answer rate', 'answers lost (ctx.needle_lost)', 'median margin', 'answer appears (lens)', 'first answer lost (lens)'].map(function (c, i) { return h('th', { class: i ? '' : 'left', text: c }); }))));
    var tb = h('tbody');
    var row = function (name, color, st, variant) {
      var lost = variant ? limitRatio(lostKey, variant, 'decode', NL, st.lost, 'global') : null;
      var at = variant && typeof st.first_lost === 'number' ? st.first_lost : null;
      var atLr = at === null ? null : limitRatio(at === NL ? lostKey : lensLostKey, variant, 'decode', at, null, 'global');
      var appears = first(st.lens);
      tb.appendChild(h('tr', { 'data-stack': name }, h('td', { class: 'left' }, h('span', { style: { color: color, fontWeight: 650 }, text: name })),
        h('td', { text: plain(st.answered) + ' of ' + plain(st.queries) }), h('td', { text: pct(st.rate) }),
        h('td', { class: lost ? ratioClass(lost.r) : '', title: variant ? gateTitle(lost) : 'the reference loses nothing by definition', text: variant ? plain(st.lost) : '–' }),
        h('td', { text: fmt(st.margin) }),
        h('td', { class: 'left' }, appears === null ? h('span', { class: 'empty', text: st.lens ? 'never' : 'not measured' }) : layerRef(appears)),
        h('td', { class: 'left ' + (atLr ? ratioClass(atLr.r) : ''), title: atLr ? gateTitle(atLr) : null }, variant ? layerRef(at) : '–')));
    };
    row('reference', REF_COLOR, ref, null);
    names.forEach(function (v) { row(v, colorOf(v), N.stacks[v], v); });
    t.appendChild(tb);
    box.appendChild(h('div', { class: 'table-wrap', style: { maxHeight: 'none' } }, t));
    var chart = h('div', { class: 'chart-card' });
    box.appendChild(chart);
    var drawLens = function () {
      clear(chart).appendChild(h('div', { class: 'head' }, h('h3', { text: 'Needle answer rate through each layer’s logit lens' })));
      var ser = [{ name: 'reference', color: REF_COLOR, values: ref.lens || null, width: 2.4 }];
      var marks = [];
      names.forEach(function (v) {
        var st = N.stacks[v];
        ser.push({ name: v, color: colorOf(v), dash: v === YARD ? '5 3' : null, values: st.lens || null, hidden: hidden.has(v) });
        if (!hidden.has(v) && typeof st.first_lost === 'number' && st.first_lost < NL) marks.push({ at: st.first_lost + 0.5, color: colorOf(v), dash: '2 2', width: 1.4 });
      });
      chart.appendChild(lineChart(Object.assign(layerAxis(), { series: ser, scale: 'linear', upperOne: true, vlines: marks, wide: true, width: 1000, height: 200,
        title: 'decode · the stack’s own head applied after each layer; a dotted line marks the first layer where a stack loses an answer' })));
    };
    redrawers.push(drawLens);
    drawLens();
    return box;
  }
  section('context', 'Context-loss lens', function (el) {
    el.appendChild(needleOutcome());
    var has = function (k) { return D.metrics && D.metrics[k]; };
    if (!['ctx.earlier_turn_mass_ref', 'ctx.needle_mass_ref', 'ctx.earlier_turn_recall', 'ctx.needle_recall'].some(has)) {
      el.appendChild(h('p', { class: 'empty', text: 'No attention or indexer context-loss metrics: the prompt has a single turn and no needles, or no query attends to an earlier turn.' })); return;
    }
    var st = { phase: PHASES.indexOf('decode') >= 0 ? 'decode' : PHASES[0], mode: 'global' };
    var needles = get(M, 'prompt', 'needles') || {};
    el.appendChild(h('p', { class: 'note', text: 'For queries in later turns and decode steps: the attention mass the reference (black) and each variant put on earlier turns and on the needles' + (Object.keys(needles).length ? ' (' + Object.keys(needles).join(', ') + ')' : '') + ', and the indexer’s recall of reference-selected rows lying there (DESIGN §3, context-loss lens). “Forgot turn 1” shows as the variant’s mass or recall falling below the reference’s.' }));
    var controls = h('div', { class: 'controls' }), leg = h('div'), grid = h('div', { class: 'chart-grid' }), tableHost = h('div');
    el.appendChild(controls); el.appendChild(leg); el.appendChild(grid); el.appendChild(tableHost);
    function refSeries(key) {
      for (var i = 0; i < VARIANTS.length; i++) { var v = series(yardMode(st.mode), VARIANTS[i], key, st.phase, 'mean') || series(st.mode, VARIANTS[i], key, st.phase, 'mean'); if (v) return v; }
      return null;
    }
    function draw() {
      clear(controls);
      controls.appendChild(selectBox('phase', PHASES, st.phase, function (v) { st.phase = v; draw(); }));
      controls.appendChild(selectBox('mode', MODES, st.mode, function (v) { st.mode = v; draw(); }));
      clear(leg).appendChild(variantLegend([{ key: 'ref', name: 'reference', color: REF_COLOR, toggle: false }]));
      clear(grid);
      [['ctx.earlier_turn_mass', 'Attention mass on earlier turns'], ['ctx.needle_mass', 'Attention mass on needles']].forEach(function (p) {
        if (!has(p[0] + '_ref')) return;
        var ser = [{ name: 'reference', color: REF_COLOR, values: refSeries(p[0] + '_ref'), width: 2.4 }];
        VARIANTS.forEach(function (v) { ser.push({ name: v, color: colorOf(v), dash: v === YARD ? '5 3' : null, values: series(v === YARD ? yardMode(st.mode) : st.mode, v, p[0] + '_opt', st.phase, 'mean'), hidden: hidden.has(v) }); });
        grid.appendChild(h('div', { class: 'chart-card' }, h('div', { class: 'head' }, h('h3', { text: p[1] })), lineChart(Object.assign(layerAxis(), { series: ser, scale: 'linear', title: st.phase + ' · mean per query' }))));
      });
      [['ctx.earlier_turn_recall', 'Indexer recall of earlier-turn rows'], ['ctx.needle_recall', 'Indexer recall of needle rows']].forEach(function (p) {
        if (!has(p[0])) return;
        grid.appendChild(h('div', { class: 'chart-card' }, h('div', { class: 'head' }, h('h3', { text: p[1] })), lineChart(Object.assign(layerAxis(), { series: variantSeries(st.mode, p[0], st.phase, 'mean'), scale: 'linear', upperOne: true, title: st.phase + ' · CSA layers' }))));
      });
      // per-variant digest
      clear(tableHost);
      var t = h('table', { class: 'data', id: 'context-table' });
      t.appendChild(h('thead', null, h('tr', null, ['variant', 'earlier-turn mass ref → variant (mean over layers)', 'change', 'needle mass ref → variant', 'min earlier-turn recall', 'min needle recall'].map(function (c, i) { return h('th', { class: i ? '' : 'left', text: c }); }))));
      var tb = h('tbody');
      var avg = function (a) { var s = 0, n = 0; (a || []).forEach(function (v) { if (finite(v)) { s += v; n++; } }); return n ? s / n : null; };
      var minAt = function (a) { var b = null, at = null; (a || []).forEach(function (v, i) { if (finite(v) && (b === null || v < b)) { b = v; at = i; } }); return b === null ? '–' : fmt(b) + ' at L' + at; };
      var refE = avg(refSeries('ctx.earlier_turn_mass_ref')), refN = avg(refSeries('ctx.needle_mass_ref'));
      VARIANTS.forEach(function (v) {
        var m = v === YARD ? yardMode(st.mode) : st.mode;
        var e = avg(series(m, v, 'ctx.earlier_turn_mass_opt', st.phase)), n = avg(series(m, v, 'ctx.needle_mass_opt', st.phase));
        var change = refE && e !== null ? (e - refE) / refE : null;
        tb.appendChild(h('tr', null, h('td', { class: 'left' }, h('span', { style: { color: colorOf(v), fontWeight: 650 }, text: v })),
          h('td', { text: fmt(refE) + ' → ' + fmt(e) }),
          h('td', { class: change !== null && change < -0.05 ? 'c-bad' : '', text: change === null ? '–' : (change >= 0 ? '+' : '') + (100 * change).toFixed(1) + '%' }),
          h('td', { text: fmt(refN) + ' → ' + fmt(n) }),
          h('td', { text: minAt(series(m, v, 'ctx.earlier_turn_recall', st.phase)) }),
          h('td', { text: minAt(series(m, v, 'ctx.needle_recall', st.phase)) })));
      });
      t.appendChild(tb);
      tableHost.appendChild(h('div', { class: 'table-wrap', style: { marginTop: '10px', maxHeight: 'none' } }, t));
    }
    redrawers.push(draw);
    draw();
  });

  // --- mHC accumulation -------------------------------------------------------------------------
  section('mhc', 'mHC accumulation', function (el) {
    var keys = familyKeys('mhc');
    if (!keys.length) { el.appendChild(h('p', { class: 'empty', text: 'No mHC metrics in this run.' })); return; }
    var st = { key: keys.indexOf('mhc.comb_rel_err@attn.hc') >= 0 ? 'mhc.comb_rel_err@attn.hc' : keys[0], phase: PHASES[0] };
    var hasLocal = MODES.indexOf('local') >= 0;
    el.appendChild(h('p', { class: 'note', text: 'How hyper-connection error builds up with depth: global (solid, the variant on its own previous output: accumulated) against local (dotted, the variant’s layer on the reference’s input: what this layer adds alone). A widening gap is accumulation; amplification is global stream error at layer L over layer L−1 (> 1: the layer amplifies incoming drift).' }));
    var controls = h('div', { class: 'controls' }), leg = h('div'), grid = h('div', { class: 'chart-grid' });
    el.appendChild(controls); el.appendChild(leg); el.appendChild(grid);
    function pairSeries(key) {
      var out = [];
      VARIANTS.forEach(function (v) {
        out.push({ name: v + ' global', color: colorOf(v), dash: v === YARD ? '5 3' : null, values: series('global', v, key, st.phase), hidden: hidden.has(v) });
        if (hasLocal) out.push({ name: v + ' local', color: colorOf(v), dash: '1.5 2.5', width: 1.3, values: series('local', v, key, st.phase), hidden: hidden.has(v), markers: false });
      });
      return out;
    }
    function draw() {
      clear(controls);
      controls.appendChild(selectBox('metric', keys.map(function (k) { return { value: k, label: labelOf(k) }; }), st.key, function (v) { st.key = v; draw(); }));
      controls.appendChild(selectBox('phase', PHASES, st.phase, function (v) { st.phase = v; draw(); }));
      clear(leg).appendChild(variantLegend([{ name: 'global', color: '#555', toggle: false }, { name: 'local', color: '#555', dot: true, toggle: false }]));
      clear(grid);
      grid.appendChild(h('div', { class: 'chart-card' }, h('div', { class: 'head' }, h('h3', { text: labelOf(st.key) })),
        lineChart(Object.assign(layerAxis(), { series: pairSeries(st.key), scale: 'log', title: st.phase + ' · global vs local' }))));
      if (D.metrics['streams.rel_l2']) grid.appendChild(h('div', { class: 'chart-card' }, h('div', { class: 'head' }, h('h3', { text: 'Hidden-stream rel L2' })),
        lineChart(Object.assign(layerAxis(), { series: pairSeries('streams.rel_l2'), scale: 'log', title: st.phase + ' · global vs local' }))));
      if (D.metrics['streams.amplification']) grid.appendChild(h('div', { class: 'chart-card' }, h('div', { class: 'head' }, h('h3', { text: 'Amplification global(L) / global(L−1)' })),
        lineChart(Object.assign(layerAxis(), { series: variantSeries('global', 'streams.amplification', st.phase, 'mean'), scale: 'linear', title: st.phase }))));
    }
    redrawers.push(draw);
    draw();
  });

  // --- attribution ----------------------------------------------------------------------------
  section('attribution', 'Attribution', function (el) {
    var A = D.attribution;
    if (!A || typeof A !== 'object') { el.appendChild(h('p', { class: 'empty', text: 'No attribution.json in this run directory (`dsv4-drift attribute` writes one: each patch alone and all-but-one, with a patch × layer blame matrix).' })); return; }
    var matrix = A.matrix && typeof A.matrix === 'object' ? A.matrix : {};
    var metrics = Object.keys(matrix);
    var patches = Array.isArray(A.patches) ? A.patches.map(String) : [];
    var v = A.verdict && typeof A.verdict === 'object' ? A.verdict : {};
    var st = { metric: metrics.indexOf(String(v.metric)) >= 0 ? String(v.metric) : metrics[0], phase: null };
    var first = A.first_divergence && typeof A.first_divergence === 'object' ? A.first_divergence : {};
    var controls = h('div', { class: 'controls' }), host = h('div');
    el.appendChild(h('p', { class: 'note', text: 'Blame per patch and layer: the drift each patch adds at that layer (mean of its add-one-in and leave-one-out effects on the loss; red = more, blue = the patch reduces it), for the chosen metric and phase. The grey row is the yardstick’s own loss for scale. An outlined cell is the patch’s first layer of divergence beyond the gate in that phase.' }));
    el.appendChild(controls); el.appendChild(host);
    function draw() {
      clear(controls); clear(host);
      if (!metrics.length) { host.appendChild(h('p', { class: 'empty', text: 'attribution.json has no blame matrix' })); }
      else {
        var entry = matrix[st.metric] || {};
        var phases = Object.keys(entry.phases || {});
        if (phases.indexOf(st.phase) < 0) st.phase = phases.indexOf(v.phase) >= 0 ? v.phase : phases[0];
        controls.appendChild(selectBox('metric', metrics.map(function (k) { return { value: k, label: labelOf(k) }; }), st.metric, function (x) { st.metric = x; draw(); }));
        controls.appendChild(selectBox('phase', phases, st.phase, function (x) { st.phase = x; draw(); }));
        if (entry.mode) controls.appendChild(h('span', { class: 'empty', text: 'measured in ' + plain(entry.mode) + ' mode' }));
        var rows = get(entry, 'phases', st.phase) || {};
        var names = patches.filter(function (p) { return rows[p]; });
        Object.keys(rows).forEach(function (p) { if (names.indexOf(p) < 0 && p.charAt(0) !== '_') names.push(p); });
        var maxAbs = 0, width = NL;
        names.forEach(function (p) { rows[p].forEach(function (x) { if (finite(x)) maxAbs = Math.max(maxAbs, Math.abs(x)); }); width = Math.max(width, rows[p].length); });
        var cellW = Math.max(15, Math.min(44, Math.floor(900 / Math.max(width, 1))));
        var t = h('table', { class: 'matrix', id: 'attribution-matrix' });
        var head = h('tr', null, h('th', { class: 'patch', text: 'patch \\ layer' }));
        var kinds = h('tr', null, h('th', { class: 'patch' }));
        for (var i = 0; i < width; i++) {
          head.appendChild(h('th', { class: 'lh', text: i === NL ? 'lg' : (cellW >= 30 || i % 5 === 0) ? String(i) : '' }));
          kinds.appendChild(h('td', { class: 'kind', style: { background: LAYERS[i] ? KIND_COLOR[LAYERS[i].kind] || '#ccc' : '#fff' }, title: LAYERS[i] ? 'L' + i + ' ' + LAYERS[i].kind : i === NL ? 'final logits' : null }));
        }
        head.appendChild(h('th', { class: 'lh', text: 'max' }));
        t.appendChild(h('thead', null, head, kinds));
        var tb = h('tbody');
        var rowFor = function (label, vals, firstLayer, isRef) {
          var tr = h('tr', null, h('th', { class: 'patch', style: isRef ? { color: YARD_COLOR, fontWeight: 400 } : null, text: label }));
          var mx = null;
          for (var i = 0; i < width; i++) {
            var x = vals ? vals[i] : null;
            if (finite(x)) mx = mx === null ? x : Math.max(mx, x);
            var bg = x === null || x === undefined ? '#f3f4f6' : !Number.isFinite(x) ? '#111' : isRef ? 'rgba(122,132,148,' + (maxAbs > 0 ? Math.min(1, Math.abs(x) / maxAbs) : 0).toFixed(2) + ')'
              : maxAbs > 0 ? (x >= 0 ? ramp(SEQ, x / maxAbs) : ramp(DIV, 0.5 + 0.5 * x / maxAbs)) : ramp(SEQ, 0);
            tr.appendChild(h('td', { class: 'cell' + (firstLayer === i ? ' first' : ''), style: { background: bg, width: cellW + 'px', minWidth: cellW + 'px' },
              title: label + ' · ' + (i === NL ? 'final logits' : 'layer ' + i + (LAYERS[i] ? ' (' + LAYERS[i].kind + ')' : '')) + ': ' + fmt(x) + (firstLayer === i ? '\nfirst divergence beyond the gate' : '') }));
          }
          tr.appendChild(h('td', { style: { paddingLeft: '6px' }, text: fmt(mx) }));
          return tr;
        };
        names.forEach(function (p) {
          var fd = (Array.isArray(first[p]) ? first[p] : []).filter(function (d) { return d && d.phase === st.phase; })[0];
          tb.appendChild(rowFor(p, rows[p], fd ? fd.first_layer : null, false));
        });
        if (rows._yardstick) tb.appendChild(rowFor('yardstick loss', rows._yardstick, null, true));
        t.appendChild(tb);
        host.appendChild(h('div', { style: { overflowX: 'auto' } }, t));
      }
      var two = h('div', { class: 'two-col', style: { marginTop: '12px' } });
      two.appendChild(h('div', null, h('h3', { text: 'Ranking (patches whose add-one-in variant fails, earliest first)' }), objectTable(A.ranking, ['patch', 'phase', 'first_layer', 'metric', 'value', 'bound', 'check'])));
      var fdRows = [];
      patches.forEach(function (p) {
        var ds = Array.isArray(first[p]) ? first[p] : [];
        if (!ds.length) fdRows.push({ patch: p, phase: null, first_layer: null });
        ds.forEach(function (d) { fdRows.push(Object.assign({ patch: p }, d)); });
      });
      two.appendChild(h('div', null, h('h3', { text: 'First divergence beyond the gate, per patch and phase' }), objectTable(fdRows, ['patch', 'phase', 'first_layer', 'metric', 'value', 'bound', 'check'])));
      host.appendChild(two);
      if (Array.isArray(A.interactions) && A.interactions.length) host.appendChild(h('div', null, h('h3', { text: 'Interactions (pairs of patches)' }), objectTable(A.interactions, ['patch', 'phase', 'first_layer', 'metric', 'value', 'bound'])));
    }
    draw();
  });

  // --- first failing layers -----------------------------------------------------------------------
  section('crossings', 'First failing layers', function (el) {
    if (CHECKS.length) {
      el.appendChild(h('p', { class: 'note', text: 'From gate.json: per check, variant and phase, the first layer where the check’s loss crosses its limit (losses are errors, or 1 − x for recall-like metrics, aggregated as the check says), where in the layer (the group of a chunk, turn, decode-step or bin scope: its positions [first, end)) and in which mode, the loss and limit there, the number of failing units, and the worst unit.' }));
      var gst = { onlyFail: failingRows().length > 0 };
      var gateHost = h('div');
      el.appendChild(h('div', { class: 'controls' }, checkBox('only failing checks', gst.onlyFail, function (x) { gst.onlyFail = x; drawGate(); })));
      el.appendChild(gateHost);
      var drawGate = function () {
        clear(gateHost);
        var order = { fail: 0, warn: 1, no_data: 2, skipped: 3, pass: 4 };
        var rows = CHECKS.filter(function (c) { return !gst.onlyFail || c.status === 'fail' || c.status === 'warn'; }).sort(function (a, b) {
          var fa = order[a.status] !== undefined ? order[a.status] : 2, fb = order[b.status] !== undefined ? order[b.status] : 2;
          if (fa !== fb) return fa - fb;
          var la = typeof a.first_failing_layer === 'number' ? a.first_failing_layer : 1e9, lb = typeof b.first_failing_layer === 'number' ? b.first_failing_layer : 1e9;
          return la - lb;
        });
        var t = h('table', { class: 'data', id: 'gate-table' });
        t.appendChild(h('thead', null, h('tr', null, ['status', 'check', 'metric', 'variant', 'phase', 'first failing layer', 'where · mode', 'loss there', 'limit there', 'failing units', 'worst loss', 'limit', 'at', 'bound'].map(function (c, i) { return h('th', { class: i < 7 || i >= 12 ? 'left' : '', text: c }); }))));
        var tb = h('tbody');
        rows.forEach(function (c) {
          var first = c.first_value !== undefined ? plain(c.first_value) : '–';
          tb.appendChild(h('tr', null, h('td', { class: 'left status-' + (c.status === 'fail' ? 'fail' : c.status === 'pass' ? 'pass' : 'other'), text: plain(c.status) }),
            h('td', { class: 'left', text: plain(c.check), title: checkInfo(c).description ? plain(checkInfo(c).description) + (checkInfo(c).aggregate ? ' (aggregate: ' + plain(checkInfo(c).aggregate) + ')' : '') : null }), h('td', { class: 'left', text: plain(c.metric) }),
            h('td', { class: 'left' }, h('span', { style: { color: colorOf(c.variant) }, text: plain(c.variant) })),
            h('td', { class: 'left', text: plain(c.phase) }), h('td', { class: 'left' }, c.status === 'fail' || typeof c.first_failing_layer === 'number' ? layerRef(c.first_failing_layer) : h('span', { class: 'empty', text: c.reason ? plain(c.reason) : '—' })),
            h('td', { class: 'left where', text: typeof c.first_failing_layer === 'number' ? unitWhere(c, 'first_') : '' }),
            h('td', { text: first }), h('td', { text: plain(c.first_limit) }), h('td', { text: c.failing_units ? String(c.failing_units) : '' }),
            h('td', { text: plain(c.worst_value) }), h('td', { text: plain(c.worst_limit !== undefined ? c.worst_limit : null) }),
            h('td', { class: 'left' }, typeof c.worst_layer === 'number' ? [layerRef(c.worst_layer), ' ', h('span', { class: 'where', text: unitWhere(c, 'worst_') })] : '–'),
            h('td', { class: 'left', text: checkInfo(c).bound_text ? plain(checkInfo(c).bound_text) : c.bound_text ? plain(c.bound_text) : plain(c.bound) })));
        });
        if (!rows.length) tb.appendChild(h('tr', null, h('td', { class: 'left empty', colspan: 14, text: 'no failing checks' })));
        t.appendChild(tb);
        gateHost.appendChild(h('div', { class: 'table-wrap', style: { maxHeight: '520px' } }, t));
      };
      drawGate();
    } else if (GATE) {
      el.appendChild(h('p', { class: 'note', text: 'gate.json lists no checks.' }));
    } else el.appendChild(h('p', { class: 'note', id: 'not-gated', text: 'Not gated: there is no gate.json, so no first failing layers (`dsv4-drift gate RUN_DIR` writes one and redraws this page).' }));
  });

  // --- findings -------------------------------------------------------------------------------
  section('findings', 'NaN/Inf findings', function (el) {
    var findings = Array.isArray(D.findings) ? D.findings : [];
    if (!findings.length) el.appendChild(h('p', { id: 'no-findings', text: 'No NaN or Inf anywhere: every tap of every stack stayed finite.' }));
    else {
      el.appendChild(h('p', { class: 'note', text: 'The first non-finite value each stack produced (later layers of that stack are not trustworthy).' }));
      el.appendChild(objectTable(findings, ['variant', 'mode', 'layer', 'tap', 'field', 'phase', 'position']));
    }
    var gf = get(GATE, 'findings');
    if (Array.isArray(gf) && gf.length) { el.appendChild(h('h3', { text: 'Non-finite findings in gate.json' })); el.appendChild(objectTable(gf, ['message'])); }
  });

  // ------------------------------------------------------------------------------------------
  // page
  // ------------------------------------------------------------------------------------------
  var app = document.getElementById('app');
  var sc = M.scenario || {};
  document.title = 'dsv4-drift · ' + plain(sc.name || 'run');
  app.appendChild(h('header', { class: 'top' }, h('h1', null, 'dsv4-drift report · ', h('span', { id: 'scenario-name', text: plain(sc.name || 'run') })),
    h('div', { class: 'sub', text: [sc.description, (get(M, 'prompt', 'n_prompt') !== undefined ? get(M, 'prompt', 'n_prompt') + ' prompt + ' + get(M, 'prompt', 'n_decode') + ' decode tokens' : null), NL + ' layers', OPT.length + ' variant(s)', get(M, 'environment', 'device_name'), M.finished || M.started].filter(Boolean).join(' · ') })));
  var nav = h('nav', { class: 'toc' });
  SECTIONS.forEach(function (sec) { nav.appendChild(h('a', { href: '#' + sec.id, text: sec.title })); });
  app.appendChild(nav);
  var main = h('main');
  app.appendChild(main);
  SECTIONS.forEach(function (sec) {
    var el = h('section', { id: sec.id }, h('h2', { text: sec.title }));
    main.appendChild(el);
    try { sec.render(el); } catch (err) {
      errors.push(sec.id + ': ' + (err && err.message));
      el.appendChild(h('div', { class: 'error-box', text: 'This section could not be drawn: ' + (err && err.message) }));
      if (window.console) console.error('report section ' + sec.id, err);
    }
  });
  app.appendChild(h('footer', { text: 'dsv4-drift report · ' + plain(D.format) + ' · ' + (D.rows || 0) + ' metric rows · self-contained: no network access' }));
  document.body.setAttribute('data-rendered', errors.length ? 'with-errors' : 'ok');
  document.body.setAttribute('data-render-ms', String(Math.round(performance.now() - started)));
})();
