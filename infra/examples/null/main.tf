terraform {
  required_providers {
    null = {
      source  = "hashicorp/null"
      version = "2.1.2"
    }
  }
}

variable "instances" {
  type    = number
  default = 2
}

variable "revision" {
  type    = string
  default = "1"
}

resource "null_resource" "node" {
  count = var.instances

  triggers = {
    revision = var.revision
  }
}

output "ids" {
  value = null_resource.node[*].id
}
