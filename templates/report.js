// report.html's only script: sortable and filterable tables, and copying the policy. With JavaScript off the
// page still shows every table (in audit order); only sorting, filtering and the copy button are lost.
(function () {
  "use strict";
  document.documentElement.className = document.documentElement.className.replace(/\bnojs\b/, "js");
  function cellValue(td) {
    if (!td) return "";
    var v = td.getAttribute("data-v");
    if (v !== null && v !== "") { var n = parseFloat(v); if (!isNaN(n)) return n; }
    var t = td.textContent.trim();
    var n2 = parseFloat(t.replace(/,/g, ""));
    return isNaN(n2) || !/^[-+]?[\d.,]+(e[-+]?\d+)?/i.test(t) ? t.toLowerCase() : n2;
  }
  function compare(x, y) {
    if (typeof x === typeof y) return x < y ? -1 : x > y ? 1 : 0;
    return typeof x === "number" ? -1 : 1;  // numbers before text in either direction
  }
  function sortBy(table, th, col) {
    var body = table.tBodies[0];
    var asc = th.getAttribute("aria-sort") !== "ascending";
    var heads = table.tHead.rows[table.tHead.rows.length - 1].cells;
    for (var i = 0; i < heads.length; i++) heads[i].removeAttribute("aria-sort");
    th.setAttribute("aria-sort", asc ? "ascending" : "descending");
    var rows = Array.prototype.slice.call(body.rows);
    var keyed = rows.map(function (r, i) { return [cellValue(r.cells[col]), i, r]; });
    keyed.sort(function (a, b) { var c = compare(a[0], b[0]); return (c === 0 ? a[1] - b[1] : c * (asc ? 1 : -1)); });
    var frag = document.createDocumentFragment();
    keyed.forEach(function (k) { frag.appendChild(k[2]); });
    body.appendChild(frag);
  }
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    if (!table.tHead) return;
    var heads = table.tHead.rows[table.tHead.rows.length - 1].cells;
    Array.prototype.forEach.call(heads, function (th, col) {
      th.tabIndex = 0;
      th.addEventListener("click", function () { sortBy(table, th, col); });
      th.addEventListener("keydown", function (e) {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sortBy(table, th, col); }
      });
    });
  });
  // A query matches a row's text as a substring; "*" stands for any characters within one word (h.*.mlp).
  function matcher(q) {
    if (q.indexOf("*") < 0) return function (t) { return t.indexOf(q) >= 0; };
    var re = new RegExp(q.split("*").map(function (p) { return p.replace(/[.+?^${}()|[\]\\]/g, "\\$&"); })
                         .join("[^ ]*"));
    return function (t) { return re.test(t); };
  }
  function openFor(input) {  // a table inside a closed <details> opens when a search looks into it
    var id = input.getAttribute("data-filter-open"), d = id && document.getElementById(id);
    if (d && !d.open) d.open = true;
  }
  function applyFilter(input, keep) {
    var table = document.getElementById(input.getAttribute("data-filter-table"));
    var status = document.getElementById(input.getAttribute("data-filter-status"));
    if (!table) return;
    var q = input.value.toLowerCase().trim(), shown = 0, rows = table.tBodies[0].rows, hit = matcher(q);
    for (var i = 0; i < rows.length; i++) {
      var ok = keep ? keep(rows[i]) : (q === "" || hit((rows[i].getAttribute("data-filter") || rows[i].textContent).toLowerCase()));
      rows[i].hidden = !ok;
      if (ok) shown++;
    }
    if (q !== "") openFor(input);
    if (status) status.textContent = q === "" ? "" : shown + " of " + rows.length + " rows";
    fitHints();
  }
  Array.prototype.forEach.call(document.querySelectorAll("input[data-filter-table]"), function (input) {
    input.addEventListener("input", function () { applyFilter(input); });
  });
  // A block's row in the grouped table: show its repeats in the full table (one click).
  Array.prototype.forEach.call(document.querySelectorAll("a.show-repeats"), function (a) {
    a.addEventListener("click", function (e) {
      var input = document.getElementById("layer-filter");
      if (!input) return;
      e.preventDefault();
      var g = a.getAttribute("data-g"), p = a.getAttribute("data-p");
      input.value = a.getAttribute("data-label");
      applyFilter(input, function (r) { return r.getAttribute("data-g") === g && r.getAttribute("data-p") === p; });
      openFor(input);
      document.getElementById("layers-all").scrollIntoView({block: "start"});
    });
  });
  Array.prototype.forEach.call(document.querySelectorAll("a.show-one"), function (a) {
    a.addEventListener("click", function () { var d = document.getElementById("layers-all"); if (d) d.open = true; });
  });
  // A table wider than its box scrolls inside it; say so above it, with how many columns are out of view.
  function fitHints() {
    Array.prototype.forEach.call(document.querySelectorAll(".tablewrap"), function (w) {
      var hint = w.previousElementSibling && w.previousElementSibling.classList.contains("scroll-hint")
        ? w.previousElementSibling : null;
      var table = w.querySelector("table");
      var wide = table && w.clientWidth > 0 && w.scrollWidth > w.clientWidth + 1;
      w.classList.toggle("scrolls", !!wide);
      if (!wide) { if (hint) hint.hidden = true; return; }
      var right = w.getBoundingClientRect().right, heads = table.tHead ? table.tHead.rows[table.tHead.rows.length - 1].cells : [];
      var out = 0;
      for (var i = 0; i < heads.length; i++) if (heads[i].getBoundingClientRect().right > right + 1) out++;
      if (!hint) {
        hint = document.createElement("p");
        hint.className = "scroll-hint noprint";
        w.parentNode.insertBefore(hint, w);
      }
      hint.hidden = false;
      hint.textContent = "\u21c6 " + (out ? out + " more column" + (out === 1 ? "" : "s") + " to the right: " : "")
        + "scroll the table sideways (shift + wheel, or the bar below it); its first column stays in view.";
    });
  }
  window.addEventListener("resize", fitHints);
  Array.prototype.forEach.call(document.querySelectorAll("details"), function (d) {
    d.addEventListener("toggle", fitHints);
  });
  Array.prototype.forEach.call(document.querySelectorAll(".controls[hidden], .js-only[hidden]"), function (el) {
    el.hidden = false;
  });
  fitHints();
  var copy = document.getElementById("copy-policy");
  var data = document.getElementById("policy-data");
  if (copy && data) {
    copy.addEventListener("click", function () {
      var text = JSON.stringify(JSON.parse(data.textContent), null, 2) + "\n";
      var done = document.getElementById("copy-status");
      function ok() { if (done) done.textContent = "copied"; }
      function fallback() {
        var area = document.createElement("textarea");
        area.value = text; document.body.appendChild(area); area.select();
        try { document.execCommand("copy"); ok(); } catch (e) { if (done) done.textContent = "select the text below and copy it"; }
        document.body.removeChild(area);
      }
      if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(text).then(ok, fallback);
      else fallback();
    });
  }
})();
