// report.html's only script: sortable and filterable tables, and copying the policy. With JavaScript off the
// page still shows every table (in audit order); only sorting, filtering and the copy button are lost.
(function () {
  "use strict";
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
  Array.prototype.forEach.call(document.querySelectorAll("input[data-filter-table]"), function (input) {
    var table = document.getElementById(input.getAttribute("data-filter-table"));
    var status = document.getElementById(input.getAttribute("data-filter-status"));
    if (!table) return;
    input.addEventListener("input", function () {
      var q = input.value.toLowerCase().trim(), shown = 0, rows = table.tBodies[0].rows;
      for (var i = 0; i < rows.length; i++) {
        var text = (rows[i].getAttribute("data-filter") || rows[i].textContent).toLowerCase();
        var hit = q === "" || text.indexOf(q) >= 0;
        rows[i].hidden = !hit;
        if (hit) shown++;
      }
      if (status) status.textContent = q === "" ? "" : shown + " of " + rows.length + " rows";
    });
  });
  Array.prototype.forEach.call(document.querySelectorAll(".controls[hidden], .js-only[hidden]"), function (el) {
    el.hidden = false;
  });
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
